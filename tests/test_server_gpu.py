"""The serving engine on CUDA (run with `-m gpu`): decode steps replayed from CUDA graphs give the
same greedy tokens as eager steps, padded graph rows never touch live pages, and the KV pools are
sized from free device memory.
"""

import pytest
import torch

from beam_model.config import FULL, SLIDING
from beam_model.model import BeamForCausalLM
from beam_model.tokenizer import ByteTokenizer
from server.engine import Engine, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32, device="cuda", seed=0)


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def test_graph_decode_equals_eager(model):
    tok = ByteTokenizer()
    ps = prompts([3, 70, 130, 17, 64, 200, 33])  # 7 sequences: padded to the batch-8 graph
    eager = Engine(model, tok, num_pages=64, cuda_graphs=False).generate(ps, GREEDY)
    graphed_engine = Engine(model, tok, num_pages=64, cuda_graphs=True, max_num_seqs=16)
    assert sorted(graphed_engine.runner.graphs) == [1, 2, 4, 8, 16]
    calls = []
    replay = graphed_engine.runner._replay
    graphed_engine.runner._replay = lambda *a: calls.append(a[0]) or replay(*a)
    steps = []
    graphed_engine.step_observer = lambda kind, n, seconds, prepare, device: steps.append((seconds, device))
    graphed = graphed_engine.generate(ps, GREEDY)
    assert calls and set(calls) <= {1, 2, 4, 8}
    assert graphed == eager
    assert graphed_engine.stats()["pages_used"] == {FULL: 0, SLIDING: 0}
    # each step's GPU time (CUDA events from the forward's launch to the drawn tokens) is within its wall time
    assert steps and all(device is not None and 0 < device < seconds for seconds, device in steps)


def test_pools_sized_from_free_memory(model):
    free_before, total = torch.cuda.mem_get_info()
    eng = Engine(model, ByteTokenizer(), gpu_memory_utilization=0.3, cuda_graphs=False)
    used = sum(t.numel() * t.element_size() for t in eng.runner.cache.storage.values())
    assert eng.num_pages[FULL] > 1000 and eng.num_pages[SLIDING] >= 2
    assert used <= 0.3 * total
    assert eng.max_model_len == model.config.max_position_embeddings
    out = eng.generate(prompts([10, 50]), SamplingParams(max_tokens=8, temperature=0.0))
    assert all(1 <= len(o) <= 8 for o in out)


class _Logits:
    """A logits hook recording each sequence's logits for each output token; given `forced` (another
    run's tokens per prompt), it then makes that token win, so both runs feed the same tokens."""

    def __init__(self, forced=None):
        self.rows, self.forced = {}, forced

    def __call__(self, seqs, logits):
        for s, row in zip(seqs, logits):
            key = tuple(s.token_ids[:s.num_prompt_tokens])
            self.rows.setdefault(key, []).append(row.clone())
            if self.forced is not None:
                token = self.forced[key][s.num_tokens - s.num_prompt_tokens]
                row.fill_(float("-inf"))
                row[token] = 0.0


@pytest.mark.parametrize("attention", ["triton", "flashinfer"])
def test_graph_decode_matches_eager_with_attention_kernels(attention):
    """The attention kernels in served graphs: Triton reads lengths on the device; FlashInfer's host
    plan is redone before every replay (`model.replan`). A graph's page table is as wide as its
    longest sequence can be, so the kernels split the keys differently than an eager step does and
    BF16 results differ in the last bits: on random weights a near-tie then flips a greedy token and
    the sequences part. So the graphed run is fed the eager run's tokens, and each step's logits must
    match the eager step's within BF16 noise (a stale length or page table is off by O(1)), with the
    same top token wherever the eager top two are further apart than that step's difference."""
    from workbench import registry

    ok, why = registry.backend_available(attention)
    if not ok:
        pytest.skip(why)
    model = BeamForCausalLM.from_preset("beam-small", dtype=torch.bfloat16, device="cuda", seed=0,
                                        variants={"attention": attention})
    tok = ByteTokenizer()
    ps = prompts([3, 70, 130, 17, 64, 700, 33])  # lengths across pages and past the window
    eager_logits = _Logits()
    eager = Engine(model, tok, num_pages=256, cuda_graphs=False, logits_hook=eager_logits).generate(ps, GREEDY)
    graphed_logits = _Logits(forced={tuple(p): out for p, out in zip(ps, eager)})
    graphed_engine = Engine(model, tok, num_pages=256, cuda_graphs=True, max_num_seqs=8, logits_hook=graphed_logits)
    calls = []
    replay = graphed_engine.runner._replay
    graphed_engine.runner._replay = lambda *a: calls.append(a[0]) or replay(*a)
    assert graphed_engine.generate(ps, GREEDY) == eager and calls
    for key, rows in eager_logits.rows.items():
        assert len(graphed_logits.rows[key]) == len(rows)
        for step, (a, b) in enumerate(zip(rows, graphed_logits.rows[key])):
            live = torch.isfinite(a)  # ids past the tokenizer's vocabulary are masked in both
            a, b = a[live], b[live]
            diff = (a - b).abs().max().item()
            assert diff <= 5e-2 * a.abs().max().item(), (attention, len(key), step, diff)
            top = a.topk(2).values
            if (top[0] - top[1]).item() > 2 * diff:
                assert a.argmax() == b.argmax(), (attention, len(key), step)
