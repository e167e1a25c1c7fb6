"""`workbench serve --tp 2` on the CPU (gloo): two processes, each with half of every layer of beam-tiny
(`--ep`: half of the experts, whole), rank 0 serving; `--tp 4`: two ranks to a kv head. Its greedy
completions are the single-process engine's; streamed and not agree; requests at once all finish; a rank
killed while serving ends the server with exit code 1 and the rank named, the request in flight getting an
error rather than a hang."""

import os
import signal
import threading
import time

import openai
import pytest
import torch

from beam_model.model import BeamForCausalLM
from beam_model.tokenizer import ByteTokenizer
from server.engine import Engine
from server.engine.sampling_params import SamplingParams
from tests.server_harness import MODEL, ServerProcess

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="Linux /proc (finding the rank's process)")
PROMPTS = ["Hello", "def fib(n):", "The quick brown fox"]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--tp", "2", scripted=False, num_pages=64)
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM), srv.log()


def _greedy(client, prompt, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, **kw)


def test_greedy_completions_are_the_single_process_engines(server):
    client = server.client()
    tok = ByteTokenizer()
    model = BeamForCausalLM.from_preset(MODEL, dtype=torch.float32, seed=0)
    engine = Engine(model, tok, num_pages=64)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    expected = engine.generate([tok.encode(p) for p in PROMPTS], params)
    for prompt, ids in zip(PROMPTS, expected):
        assert _greedy(client, prompt).choices[0].text == tok.decode(ids), prompt


def test_streamed_and_concurrent_requests(server):
    client = server.client()
    full = _greedy(client, PROMPTS[1]).choices[0].text
    streamed = "".join(c.choices[0].text for c in _greedy(client, PROMPTS[1], stream=True) if c.choices)
    assert streamed == full
    results, errors = [], []

    def one(i):
        try:
            r = client.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=6, temperature=0.7, seed=i)
            results.append(r.usage.completion_tokens)
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 6 and all(1 <= n <= 6 for n in results)


def _rank_pids(server_pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == server_pid:
                        with open(f"/proc/{name}/cmdline") as c:
                            if "multiprocessing" in c.read():
                                found.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return found


def test_a_killed_rank_ends_the_server_with_its_name():
    srv = ServerProcess("--tp", "2", scripted=False, num_pages=64)
    try:
        ranks = [p for p in _rank_pids(srv.proc.pid) if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGKILL)
        with pytest.raises((openai.APIError, openai.APIConnectionError)):
            for _ in range(20):  # the first requests may finish before the rank's death is seen
                _greedy(srv.client(), "still there?")
                time.sleep(0.1)
        code = srv.proc.wait(timeout=60)
        assert code == 1, srv.log()
        assert "rank 1 exited with code -9" in srv.log()
    finally:
        srv.stop()


def test_a_model_that_does_not_divide_is_refused_before_any_rank_starts(capsys):
    from workbench.cli import main

    assert main(["serve", "--tp", "3", "--preset", MODEL, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "cannot shard the config over 3 ranks" in err and "num_attention_heads=4" in err


def test_expert_parallel_ranks_serve_the_single_process_engines_completions():
    """`--tp 2 --ep`: each rank holds half the experts whole; greedy text is the single process's."""
    srv = ServerProcess("--tp", "2", "--ep", scripted=False, num_pages=64)
    try:
        tok = ByteTokenizer()
        engine = Engine(BeamForCausalLM.from_preset(MODEL, dtype=torch.float32, seed=0), tok, num_pages=64)
        expected = engine.generate([tok.encode(p) for p in PROMPTS], SamplingParams(max_tokens=8, temperature=0.0))
        for prompt, ids in zip(PROMPTS, expected):
            assert _greedy(srv.client(), prompt).choices[0].text == tok.decode(ids), prompt
        assert "TP2 EP" in srv.log()
    finally:
        assert srv.stop() in (0, -signal.SIGTERM), srv.log()


def test_four_ranks_sharing_the_kv_heads_serve_the_single_process_engines_completions():
    """`--tp 4` on beam-tiny's 2 kv heads: each rank holds the kv head its query head reads."""
    srv = ServerProcess("--tp", "4", scripted=False, num_pages=64)
    try:
        tok = ByteTokenizer()
        engine = Engine(BeamForCausalLM.from_preset(MODEL, dtype=torch.float32, seed=0), tok, num_pages=64)
        expected = engine.generate([tok.encode(p) for p in PROMPTS[:2]], SamplingParams(max_tokens=8, temperature=0.0))
        for prompt, ids in zip(PROMPTS[:2], expected):
            assert _greedy(srv.client(), prompt).choices[0].text == tok.decode(ids), prompt
    finally:
        assert srv.stop() in (0, -signal.SIGTERM), srv.log()


def test_ranks_serve_a_quantized_model():
    """`--tp 2 --weights fp8`: each rank reads its slices of the FP8 codes and their per-row scales; greedy
    text is the single process's on the same FP8 model."""
    srv = ServerProcess("--tp", "2", "--weights", "fp8", scripted=False, num_pages=64)
    try:
        tok = ByteTokenizer()
        model = BeamForCausalLM.from_preset(MODEL, dtype=torch.float32, seed=0, weights="fp8")
        expected = Engine(model, tok, num_pages=64).generate([tok.encode(p) for p in PROMPTS[:1]],
                                                             SamplingParams(max_tokens=8, temperature=0.0))
        assert _greedy(srv.client(), PROMPTS[0]).choices[0].text == tok.decode(expected[0])
    finally:
        assert srv.stop() in (0, -signal.SIGTERM), srv.log()


def test_expert_parallelism_needs_ranks(capsys):
    from workbench.cli import main

    assert main(["serve", "--ep", "--preset", MODEL, "--device", "cpu"]) == 2
    assert "--ep splits the experts over the --tp ranks" in capsys.readouterr().err
