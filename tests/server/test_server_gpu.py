"""The serving engine on CUDA (run with `-m gpu`): decode steps replayed from CUDA graphs give the
same greedy tokens as eager steps (FP32) and draw their tokens inside the graph, each replay equals an
eager step on its inputs bit for bit with every attention backend (BF16), padded graph rows never touch
live pages, the KV pools are sized from free device memory, and a drafter's greedy verify and draft
steps replay one graph each and keep the target's output.
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
    graphed_engine.step_observer = lambda kind, n, seconds, prepare, device, grammar: steps.append((seconds, device))
    graphed = graphed_engine.generate(ps, GREEDY)
    assert calls and set(calls) <= {1, 2, 4, 8}
    assert graphed == eager
    assert graphed_engine.stats()["pages_used"] == {FULL: 0, SLIDING: 0}
    # each step's GPU time (CUDA events from the forward's launch to the drawn tokens) is within its wall time
    assert steps and all(device is not None and 0 < device < seconds for seconds, device in steps)


def test_graph_decode_draws_tokens_inside_the_graph(model):
    """Each decode replay draws its rows' tokens inside the graph: no sampling launched after it, each
    row at its own settings (top_k 1 at temperature 1 gives the greedy tokens), and the engine's
    generator moves on with every replay (the graph registered it), so draws do not repeat."""
    tok = ByteTokenizer()
    ps = prompts([3, 70, 130])
    eager = Engine(model, tok, num_pages=64, cuda_graphs=False).generate(ps, GREEDY)
    engine = Engine(model, tok, num_pages=64, cuda_graphs=True, max_num_seqs=4)
    runner = engine.runner
    assert all(c.ids is not None for c in runner.graphs.values())
    eager_draws, offsets = [], []
    masked = runner._masked
    runner._masked = lambda logits: eager_draws.append(logits.shape[0]) or masked(logits)
    replay = runner._replay

    def replay_noting_the_generator(*a):
        offsets.append(runner.generator.get_offset())
        return replay(*a)

    runner._replay = replay_noting_the_generator
    top1 = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=1.0, top_k=1, ignore_eos=True)
    assert engine.generate(ps, [top1, GREEDY, top1]) == eager
    prefills = len(eager_draws)
    sampled = engine.generate(ps, SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True))
    assert all(len(o) == 16 and max(o) < runner.vocab_limit for o in sampled) and sampled != [e[:16] for e in eager]
    assert len(eager_draws) <= prefills + len(ps)  # the prompts' steps only
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)


def test_pools_sized_from_free_memory(model):
    free_before, total = torch.cuda.mem_get_info()
    eng = Engine(model, ByteTokenizer(), gpu_memory_utilization=0.3, cuda_graphs=False)
    used = sum(t.numel() * t.element_size() for t in eng.runner.cache.storage.values())
    assert eng.num_pages[FULL] > 1000 and eng.num_pages[SLIDING] >= 2
    assert used <= 0.3 * total
    assert eng.max_model_len == model.config.max_position_embeddings
    out = eng.generate(prompts([10, 50]), SamplingParams(max_tokens=8, temperature=0.0))
    assert all(1 <= len(o) <= 8 for o in out)


@pytest.mark.parametrize("attention", ["torch", "triton", "flashinfer"])
def test_graph_replay_equals_an_eager_step_on_its_inputs(attention):
    """Every served graph replay gives the same logits, bit for bit, as an eager step on the inputs
    the replay was given (the graph's buffers and metadata): nothing the graph captured goes stale
    (lengths, page tables, FlashInfer's host plan, redone by `model.replan` before each replay).

    Not compared with an eager *engine*: its steps have narrower page tables and no padded rows, so
    the kernels split keys differently and BF16 results differ in the last bits; on random weights
    that flips near-tied expert choices, and the logits then part by O(1) (seen on the H200, and on
    the CPU with the reference attention: `runs/check-tp8-backends/README.md`). The op-level tests
    check each kernel's graph replays with new lengths (`check_graph_replay`)."""
    from workbench import registry

    ok, why = registry.backend_available(registry.get("attention", attention).backend)
    if not ok:
        pytest.skip(why)
    model = BeamForCausalLM.from_preset("beam-small", dtype=torch.bfloat16, device="cuda", seed=0,
                                        variants={"attention": attention})
    engine = Engine(model, ByteTokenizer(), num_pages=256, cuda_graphs=True, max_num_seqs=8)
    runner, checked = engine.runner, []
    replay = runner._replay

    def replay_then_step(size, *args):
        captured = replay(size, *args)
        logits, meta = captured.logits[:len(args[0])].clone(), captured.meta
        with torch.inference_mode():  # writes the same K/V to the same slots again
            eager = runner.model.step(runner._inputs.ids[:size], runner.cache, meta)[:logits.shape[0]]
        checked.append(size)
        assert torch.equal(logits, eager), (attention, size, (logits.float() - eager.float()).abs().max().item())
        return captured

    runner._replay = replay_then_step
    out = engine.generate(prompts([3, 70, 130, 17, 64, 700, 33]), GREEDY)  # across pages, past the window
    assert checked and all(len(o) == GREEDY.max_tokens for o in out)


def test_graph_decode_draws_structured_rows_under_their_masks(model):
    """The grammar path on real CUDA graphs: the host fills the constrained rows' masks while the
    forward graph runs, the draw graph samples under them; structured rows end as valid JSON, and the
    unconstrained greedy rows beside them keep the eager engine's tokens."""
    import json

    pytest.importorskip("llguidance", reason="the grammar engine (a project dependency; the GPU host's python "
                                             "has it only from the GPU bundle)")
    from server.api.structures import completion_structure

    tok = ByteTokenizer()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    structured = SamplingParams(max_tokens=60, temperature=1.0, structure=completion_structure(schema))
    ps = prompts([5, 40, 9, 70])
    eager = Engine(model, tok, num_pages=64, cuda_graphs=False).generate(ps[2:], GREEDY)
    engine = Engine(model, tok, num_pages=64, cuda_graphs=True, max_num_seqs=8)
    out = engine.generate(ps, [structured, structured, GREEDY, GREEDY])
    for ids in out[:2]:
        assert ids[-1] == tok.eos_token_id
        value = json.loads(tok.decode(ids[:-1]))
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] <= 99
    assert out[2:] == eager



def test_verify_and_draft_replay_one_graph_and_keep_greedy_output(model):
    """Greedy requests with a drafter: each verify step (with the next block's drafting) is one replay
    of a padded graph (batch sizes 1, 2, 4; blocks of 1, 2, 4 and K + 1 = 8 rows; with and without sampling),
    under batching, and the output is the target's own token for token (FP32)."""
    from beam_model.drafter_config import DrafterConfig
    from workbench.training.drafter import initial_drafter

    tok = ByteTokenizer()
    ps = prompts([3, 70, 130])
    plain = Engine(model, tok, num_pages=64, cuda_graphs=True, max_num_seqs=4).generate(ps, GREEDY)
    drafter = initial_drafter(DrafterConfig.for_target(model.config, num_hidden_layers=1, block_size=8), model,
                              seed=0, device="cuda")
    engine = Engine(model, tok, num_pages=64, max_num_seqs=4, drafter=drafter, num_speculative_tokens=7)
    fused = engine.speculator.fused
    assert fused is not None and sorted(fused.graphs) == [(b, w, sampled) for b in (1, 2, 4) for w in (1, 2, 4, 8)
                                                          for sampled in (False, True)]
    # what a verified draft costs adaptive verification: the device's time of a row, timed on the greedy graphs
    assert 0 < engine.speculator.cost.per_token_s < 1e-3
    replays = []
    for shape, (graph, meta, out) in fused.graphs.items():
        fused.graphs[shape] = (type("Noted", (), {"replay": lambda self, g=graph, n=shape: replays.append(n) or
                                                  g.replay()})(), meta, out)
    assert engine.generate(ps, GREEDY) == plain
    # every request greedy: the graphs without distributions, at the batch of all three
    assert fused.steps > 0 and len(replays) == fused.steps and {(b, s) for b, _, s in replays} == {(4, False)}
    assert engine.stats()["pages_used"] == {FULL: 0, SLIDING: 0}
