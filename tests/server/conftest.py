"""Fixtures of the engine-level server tests: one intra-op thread, and beam-tiny in FP32 on the CPU."""

import pytest
import torch

from beam_model.model import BeamForCausalLM


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matmuls: threads only add OpenMP overhead (and stall badly on a busy machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    return BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32, seed=0)
