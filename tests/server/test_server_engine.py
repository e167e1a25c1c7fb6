"""The serving engine without HTTP: page ownership, prefix caching, stop strings, and continuous
batching giving the same greedy tokens as serving each request alone (and as beam_model.generate).

beam-tiny in FP32 on the CPU: window 16, pages of 64 tokens, vocab 288.
"""

import pytest
import torch

from beam_model.config import FULL, SLIDING
from beam_model.generate import generate
from beam_model.tokenizer import ByteTokenizer, StreamDecoder
from server.engine import Engine, SamplingParams
from server.engine.block_manager import BlockManager
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.output import TokenLogprob
from server.engine.sequence import Sequence
from server.engine.testing import ScriptedLogits

PS, W = 64, 16


class FullVocabTokenizer:
    """Decodes every id of the model's padded vocab (so the engine may sample all 288, like generate)."""

    vocab_size, eos_token_id = 288, 264

    def stream_decoder(self):
        return StreamDecoder(lambda ids: "".join(chr(0x100 + i) for i in ids))






def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def seq(tokens, params=None):
    return Sequence("r", tokens, params or SamplingParams(), IncrementalDetokenizer(ByteTokenizer()))


# ------------------------------------------------------------------ block manager

def test_pages_refcounted_and_sliding_pages_released_as_the_window_moves():
    bm = BlockManager({FULL: 8, SLIDING: 8}, page_size=PS, window=W)
    s = seq(list(range(200)))
    bm.allocate(s, 200)
    assert len(s.pages[FULL]) == len(s.pages[SLIDING]) == 4 and bm.used(FULL) == 4
    assert 0 not in s.pages[FULL] + s.pages[SLIDING]  # page 0 is reserved
    s.num_computed = 200
    bm.release_window(s)  # the next query (position 200) sees 185..200: pages 0-1 can go, 2 stays
    assert s.pages[SLIDING][:2] == [-1, -1] and min(s.pages[SLIDING][2:]) > 0
    assert bm.used(SLIDING) == 2 and bm.used(FULL) == 4
    bm.free(s)
    assert bm.used(FULL) == bm.used(SLIDING) == 0 and s.num_computed == 0


def _computed(bm, tokens):
    s = seq(tokens)
    bm.allocate(s, len(tokens))
    s.num_computed = len(tokens)
    bm.commit(s)
    return s


def test_prefix_reuse_needs_full_pages_and_the_last_window_of_sliding_pages():
    bm = BlockManager({FULL: 16, SLIDING: 16}, page_size=PS, window=W)
    tokens = list(range(3 * PS + 10))
    first = _computed(bm, tokens)
    bm.release_window(first)  # sliding pages 0 and 1 leave the window (refcount 0, still cached)
    hashes = list(first.page_hashes)
    bm.free(first)
    assert bm.used(FULL) == 0 and bm.cached(FULL) == 3 and bm.cached(SLIDING) == 3
    again = seq(tokens + [7])
    assert bm.match_prefix(again) == 3 * PS
    assert again.pages[SLIDING][:2] == [-1, -1] and again.pages[SLIDING][2] > 0  # only the last window
    assert again.pages[FULL] == first_pages(bm, again) and bm.used(FULL) == 3
    bm.free(again)
    # A different continuation inside page 2 shares only pages 0-1; but the sliding page 1 then
    # needed for the window before position 128 is gone once evicted -> fall back to page 0 only.
    other = tokens[:2 * PS + 5] + [999]
    sliding_page_1 = bm.pools[SLIDING].page_of[hashes[1]]
    pool = bm.pools[SLIDING]
    del pool.page_of[pool.hash_of.pop(sliding_page_1)]
    del pool.evictable[sliding_page_1]
    pool.free.append(sliding_page_1)
    s = seq(other)
    assert bm.match_prefix(s) == PS


def first_pages(bm, s):
    return [bm.pools[FULL].page_of[h] for h in s.page_hashes]


def test_unreferenced_cached_pages_are_evicted_lru_first():
    bm = BlockManager({FULL: 4, SLIDING: 8}, page_size=PS, window=W, prefix_caching=True)
    a = _computed(bm, list(range(PS + 1)))
    bm.free(a)
    b = _computed(bm, list(range(100, 100 + PS + 1)))
    bm.free(b)
    assert bm.cached(FULL) == 2 and bm.available(FULL) == 3
    c = seq(list(range(500, 500 + 2 * PS)))
    bm.allocate(c, 2 * PS)  # 1 free page + evicts a's page (the older one)
    assert bm.match_prefix(seq(list(range(PS + 1)))) == 0
    d = seq(list(range(100, 100 + PS + 1)))
    assert bm.match_prefix(d) == PS


# ------------------------------------------------------------------ stop strings

def test_stop_strings_spanning_tokens_are_cut_and_never_shown():
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok, stop=("END", "xyz"))
    out = "".join(d.add(t) for t in tok.encode("hello EN"))
    assert out == "hello " and not d.stopped  # "EN" is held: it may become "END"
    out += d.add(tok.encode("D")[0])
    assert d.stopped and out == "hello "
    d = IncrementalDetokenizer(tok, stop=("END",))
    out = "".join(d.add(t) for t in tok.encode("an E and Zürich")) + d.flush()
    assert out == "an E and Zürich" and not d.stopped


# ------------------------------------------------------------------ continuous batching

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
LENGTHS = [5, 70, 130, 17, 64, 200, 33, 1]


def test_concurrent_greedy_equals_one_at_a_time_and_the_reference(model):
    tok = FullVocabTokenizer()
    ps = prompts(LENGTHS)
    alone = [Engine(model, tok, num_pages=32).generate([p], GREEDY)[0] for p in ps]
    # generate() is beam_model's plain prefill-then-decode loop over its own cache.
    assert alone[:3] == [generate(model, [p], 20)[0] for p in ps[:3]]
    together = Engine(model, tok, num_pages=64).generate(ps, GREEDY)
    assert together == alone
    # chunked prefill (budget 48 tokens) and a pool so small that sequences get preempted
    tight = Engine(model, tok, num_pages=6, max_num_batched_tokens=48, prefix_caching=False)
    assert tight.generate(ps, GREEDY) == alone
    assert tight.scheduler.num_preemptions > 0
    assert tight.stats()["pages_used"] == {FULL: 0, SLIDING: 0}


def test_prefix_cache_hits_give_the_same_tokens(model):
    tok = FullVocabTokenizer()
    base = prompts([150])[0]
    eng = Engine(model, tok, num_pages=32)
    first = eng.generate([base], GREEDY)[0]
    assert eng.stats()["prefix_hit_tokens"] == 0
    again = eng.generate([base, base + first[:3]], GREEDY)
    assert again[0] == first
    assert again[1] == Engine(model, tok, num_pages=32, prefix_caching=False).generate([base + first[:3]], GREEDY)[0]
    assert eng.stats()["prefix_hit_tokens"] == 2 * 128  # two full pages each


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    tok = FullVocabTokenizer()
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    ps = prompts([12, 40, 90])
    alone = Engine(model, tok, num_pages=32).generate([ps[0]], p)[0]
    mixed = Engine(model, tok, num_pages=32).generate(
        ps, [p, SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True), GREEDY])
    assert mixed[0] == alone
    other = Engine(model, tok, num_pages=32).generate([ps[0]], SamplingParams(
        max_tokens=16, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True))[0]
    assert other != alone


def test_sliding_pages_stay_bounded_during_a_long_decode(model):
    tok = FullVocabTokenizer()
    eng = Engine(model, tok, num_pages=16)
    eng.add_request("long", prompts([10])[0], SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True))
    peak = 0
    while eng.has_unfinished():
        eng.step()
        peak = max(peak, eng.stats()["pages_used"][SLIDING])
    assert peak <= 2 and eng.stats()["pages_used"] == {FULL: 0, SLIDING: 0}


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(model):
    tok = ByteTokenizer()
    hook = ScriptedLogits(tok, [{"when": "boom", "reply": "abc", "fail_at": 2},
                                {"when": "hello", "reply": "hi there"}])
    eng = Engine(model, tok, num_pages=16, logits_hook=hook)
    eng.add_request("a", tok.encode("boom"), SamplingParams(max_tokens=10))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].finish_reason == "error" and "scripted failure" in outs[-1].error
    assert [o.token_ids for o in outs[:-1]] == [[ord("a")], [ord("b")]]
    assert eng.stats()["pages_used"] == {FULL: 0, SLIDING: 0}
    text = tok.decode(eng.generate([tok.encode("hello")], SamplingParams(max_tokens=30))[0])
    assert text == "hi there<|end|>"


def test_requests_that_cannot_fit_are_refused(model):
    eng = Engine(model, ByteTokenizer(), num_pages=4)  # 3 pages: a context of 192 tokens
    assert eng.max_model_len == 3 * PS
    with pytest.raises(ValueError, match="context length"):
        eng.add_request("x", [1] * 150, SamplingParams(max_tokens=50))
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request("y", [1, 300], SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


# ------------------------------------------------------------------ randomized page bookkeeping

class CheckingRunner:
    """Stands in for the model: remembers which prefix each written KV slot belongs to, and checks
    that every slot a step's queries may read (all positions on full layers, the last W on sliding
    ones) holds exactly this sequence's prefix. Next token: a function of the tokens so far."""

    def __init__(self, page_size, window):
        self.ps, self.w = page_size, window
        self.slots = {FULL: {}, SLIDING: {}}

    def run(self, seqs, counts):
        out = []
        for s, n in zip(seqs, counts):
            c, ps = s.num_computed, self.ps
            keys = [hash(tuple(s.token_ids[:p + 1])) for p in range(c + n)]
            for t in range(c, c + n):
                for g in (FULL, SLIDING):
                    page = s.pages[g][t // ps]
                    assert page > 0, f"token {t} of {s.request_id} writes to page {page} ({g})"
                    self.slots[g][page, t % ps] = keys[t]
            for q in range(c, c + n):
                for g, lo in ((FULL, 0), (SLIDING, max(0, q - self.w + 1))):
                    for p in range(lo, q + 1):
                        page = s.pages[g][p // ps]
                        assert page > 0 and self.slots[g].get((page, p % ps)) == keys[p], \
                            f"{s.request_id}: {g} position {p} (query {q}) reads a wrong slot"
            done = c + n == s.num_tokens
            out.append(TokenLogprob(sum(s.token_ids) * 31 % 250, 0.0) if done else None)
        return out


def check_pools(eng):
    """Reference counts equal the page-list entries of live sequences; every page is exactly one of
    free, cached-unreferenced or referenced; the prefix index is consistent."""
    bm = eng.block_manager
    live = eng.scheduler.running + list(eng.scheduler.waiting)
    for g, pool in bm.pools.items():
        held = {}
        for s in live:
            for p in s.pages[g]:
                if p >= 0:
                    held[p] = held.get(p, 0) + 1
        assert {p: r for p, r in enumerate(pool.ref) if r} == held
        free, cached = set(pool.free), set(pool.evictable)
        assert len(free) == len(pool.free) and not free & cached and not (free | cached) & set(held)
        assert free | cached | set(held) == set(range(1, pool.num_pages))
        assert all(pool.page_of[h] == p for p, h in pool.hash_of.items()) and cached <= set(pool.hash_of)


@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_keeps_pages_consistent(model, seed):
    import random

    rng = random.Random(seed)
    budget = rng.choice([16, 64, 256])
    eng = Engine(model, FullVocabTokenizer(), num_pages=rng.choice([6, 7, 9]), max_num_seqs=6,
                 max_num_batched_tokens=budget)
    eng.runner = CheckingRunner(PS, W)
    bases = [[rng.randrange(256) for _ in range(n)] for n in (0, 64, 130, 200)]
    pending = [(f"r{i}",
                rng.choice(bases)[:rng.randint(0, 200)] + [rng.randrange(256) for _ in range(rng.randint(1, 40))],
                SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.0, ignore_eos=True)) for i in range(60)]
    finished, aborted, lengths = {}, set(), {r: p.max_tokens for r, _, p in pending}
    while pending or eng.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                eng.add_request(*pending.pop())
        if eng.requests and rng.random() < 0.05:
            rid = rng.choice(list(eng.requests))
            eng.abort(rid)
            aborted.add(rid)
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o.num_output_tokens
        check_pools(eng)
    assert set(finished) | aborted == set(lengths) and not set(finished) & aborted
    assert all(n == lengths[r] for r, n in finished.items())  # every survivor ran to max_tokens
    stats = eng.stats()
    assert stats["pages_used"] == {FULL: 0, SLIDING: 0} and stats["prefix_hit_tokens"] > 0
    print(f"seed {seed}: {stats['preemptions']} preemptions, {stats['prefix_hit_tokens']} cached tokens")


def test_warm_up_runs_prompt_and_mixed_steps_and_leaves_nothing(model):
    """Start-up steps: a prompt alone, then a prompt beside a decode (mixed), at each token-count class;
    afterwards no request, no page in use, and the engine serves exactly as one that never warmed up."""
    tok = FullVocabTokenizer()
    eng = Engine(model, tok, num_pages=64)  # room for two ~1K-token prompts at once
    kinds = []
    eng.step_observer = lambda kind, num_seqs, *times: kinds.append((kind, num_seqs))
    assert eng.warm_up_lengths() == [17, 18, 32, 1009, 1010, 1008]  # CPU: a step takes at most 1024 tokens
    assert eng.warm_up() == len(kinds)
    assert kinds[:2] == [("prefill", 1), ("mixed", 2)] and kinds.count(("mixed", 2)) == 6 and ("decode", 1) in kinds
    assert not eng.has_unfinished() and not eng.requests and eng.stats()["pages_used"] == {FULL: 0, SLIDING: 0}
    eng.step_observer = None
    ps, greedy = prompts([9, 40], seed=3), SamplingParams(max_tokens=12, temperature=0.0)
    assert eng.generate(ps, greedy) == Engine(model, tok, num_pages=64).generate(ps, greedy)


def test_warm_up_skips_prompts_past_the_context(model, monkeypatch):
    from server.engine import llm_engine

    monkeypatch.setattr(llm_engine, "WARM_UP_PROMPT_TOKENS", (17, 62))
    eng = Engine(model, FullVocabTokenizer(), num_pages=2)  # one usable page: a context of 64 tokens
    assert eng.warm_up_lengths() == [17]  # 62 + 3 tokens and the long scale do not fit
    only_17 = eng.warm_up()
    monkeypatch.setattr(llm_engine, "WARM_UP_PROMPT_TOKENS", (17,))
    assert eng.max_model_len == 64 and only_17 == Engine(model, FullVocabTokenizer(), num_pages=2).warm_up()


def test_a_failing_warm_up_names_the_step(model):
    tok = ByteTokenizer()
    hook = ScriptedLogits(tok, [{"when": "", "reply": "x", "fail_at": 0}])
    with pytest.raises(RuntimeError, match="warm-up step failed .17-token prompts.: .*scripted failure"):
        Engine(model, tok, num_pages=16, logits_hook=hook).warm_up()


def test_a_slow_step_is_logged_with_its_shape(model, monkeypatch, caplog):
    from server.engine import llm_engine

    monkeypatch.setattr(llm_engine, "SLOW_STEP_SECONDS", 0.0)  # every step counts as slow
    eng = Engine(model, FullVocabTokenizer(), num_pages=16)
    with caplog.at_level("WARNING", logger="beam.engine"):
        eng.warm_up()  # compiling is what warm-up steps are for: never logged
        assert not caplog.text
        eng.generate(prompts([5]), SamplingParams(max_tokens=2, temperature=0.0))
    assert "slow prefill step" in caplog.text and "1 sequences, tokens fed [5]" in caplog.text
    assert "slow decode step" in caplog.text


def test_a_slow_step_names_the_triton_kernels_it_specialised_first(model, monkeypatch, caplog):
    """Triton's jit_cache_hook fires inside the step (as at a first-seen shape): the slow-step line names
    the kernel, the engine keeps its signature, and the hook lets the launch go on (returns None)."""
    knobs = pytest.importorskip("triton").knobs
    from server.engine import llm_engine

    monkeypatch.setattr(llm_engine, "SLOW_STEP_SECONDS", 0.0)
    eng = Engine(model, FullVocabTokenizer(), num_pages=16)
    signature = "_route_select[num_warps=4](part_ptr: *fp32, N: i32)"
    run = eng.runner.run

    def compiling_run(*args):
        assert knobs.runtime.jit_cache_hook(key=None, repr=signature, fn=None, compile={}, is_manual_warmup=False,
                                            already_compiled=False) is None
        return run(*args)

    monkeypatch.setattr(eng.runner, "run", compiling_run)
    with caplog.at_level("WARNING", logger="beam.engine"):
        eng.generate(prompts([5]), SamplingParams(max_tokens=1, temperature=0.0))
    assert "Triton kernels first specialised in it: _route_select" in caplog.text
    assert eng.last_first_uses == [signature]


def test_first_use_keeps_an_earlier_hook_and_counts_names(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    from server.engine import first_use

    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: calls.append(kw["repr"]))
    monkeypatch.setattr(first_use, "_installed", False)
    assert first_use.install() and first_use.install()  # a second install adds no second hook
    first_use.take()
    for r in ("a[num_warps=4](x: i32)", "b[num_warps=8]()", "a[num_warps=4](x: i1)"):
        knobs.runtime.jit_cache_hook(repr=r)
    taken = first_use.take()
    assert calls == taken == ["a[num_warps=4](x: i32)", "b[num_warps=8]()", "a[num_warps=4](x: i1)"]
    assert first_use.summary(taken) == "a x2, b" and first_use.take() == []


def test_first_use_probe_script_records_every_step(tmp_path):
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "probe.json"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, os.path.join(root, "scripts", "serve_first_use_probe.py"), "--device", "cpu",
                    "--dtype", "fp32", "--users", "2", "--prompt-tokens", "9", "--max-tokens", "3",
                    "--arrive-every", "1", "--out", str(out)], check=True, capture_output=True, timeout=300)
    probe = json.loads(out.read_text())
    assert probe["warm_up"]["steps"] > 0
    assert [s["kind"] for s in probe["steps"]] == ["prefill", "mixed", "decode", "decode"]
    assert [s["tokens_fed"] for s in probe["steps"]] == [[9], [1, 9], [1, 1], [1]]


def test_graph_decode_emulation_script_replays_the_runners_graph_inputs():
    """scripts/graph_decode_emulation.py stands in for `ModelRunner._capture` on the CPU, so it must build
    the buffers `_replay` refills: in FP32 the graph-shaped steps give the eager engine's tokens."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", "graph_decode_emulation.py"), "--preset",
                           "beam-tiny", "--dtype", "float32", "--prompts", "3,70", "--tokens", "3"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 emulated graph replays" in proc.stdout and "prompt of   70 tokens" in proc.stdout


def _emulated_graph_engine(model, monkeypatch):
    """An Engine whose decode "graphs" are scripts/graph_decode_emulation.py's: `ModelRunner`'s graph
    buffers, metadata and draw, each replay an eager step then the graph's `_draw`."""
    import importlib.util
    import os

    from server.engine import llm_engine

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts",
                        "graph_decode_emulation.py")
    spec = importlib.util.spec_from_file_location("graph_decode_emulation", path)
    emulation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulation)
    monkeypatch.setattr(llm_engine, "ModelRunner", emulation._emulated_runner)
    engine = Engine(model, ByteTokenizer(), num_pages=64, cuda_graphs=True, max_num_seqs=4)
    monkeypatch.undo()
    steps = []  # (kind, drew eagerly) of each step
    masked = engine.runner._masked
    engine.runner._masked = lambda logits: steps.append("eager draw") or masked(logits)
    engine.step_observer = lambda kind, *_: steps.append(kind)
    return engine, steps


def _eager_draw_steps(steps):
    """The kinds of the steps that drew their tokens outside the graph."""
    return [kind for drew, kind in zip(steps, steps[1:]) if drew == "eager draw"]


def test_graph_decode_draws_in_the_graph_with_each_rows_settings(model, monkeypatch):
    """A graphed decode step's tokens are the graph's draw (no sampling launched after it) at each row's
    own settings from the graph inputs: top_k 1 or a tiny top_p at temperature 1 give the greedy tokens,
    as the eager engine's do; a seeded request (its own generator) and logprobs are drawn eagerly."""
    ps = prompts([5, 70, 20])
    eager = Engine(model, ByteTokenizer(), num_pages=64).generate(ps, GREEDY)
    engine, steps = _emulated_graph_engine(model, monkeypatch)
    narrow = [SamplingParams(max_tokens=GREEDY.max_tokens, temperature=1.0, top_k=1, ignore_eos=True),
              SamplingParams(max_tokens=GREEDY.max_tokens, temperature=1.0, top_p=1e-6, ignore_eos=True), GREEDY]
    assert engine.generate(ps, narrow) == eager
    assert steps.count("decode") >= GREEDY.max_tokens - 1 and "decode" not in _eager_draw_steps(steps)
    sampled = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    out = engine.generate(ps, sampled)
    assert all(len(o) == 8 and max(o) < engine.runner.vocab_limit for o in out) and out != eager

    steps.clear()
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    alone = Engine(model, ByteTokenizer(), num_pages=64).generate([ps[0]], seeded)[0]
    assert engine.generate(ps, [seeded, sampled, GREEDY])[0] == alone
    # the seeded row's 7 decode steps draw outside the graph, the greedy row's 12 after it in the graph
    assert _eager_draw_steps(steps).count("decode") == 7 and steps.count("decode") == GREEDY.max_tokens - 1
    steps.clear()
    with_logprobs = SamplingParams(max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=2, ignore_eos=True)
    assert engine.generate([ps[1]], with_logprobs)[0] == eager[1][:4]
    assert _eager_draw_steps(steps).count("decode") == 3


def test_first_use_signature_names_constexprs_and_divisible_arguments():
    """The hook's arguments as Triton 3.4-3.9 pass them: argument types by name, constexprs and
    attributes by argument index. Anything else falls back to Triton's repr."""
    import types

    from server.engine.first_use import _signature

    compile = {"signature": {"x_ptr": "*bf16", "N": "i32", "K": "i32", "BLOCK": "constexpr"},
               "constants": {(3,): 64}, "configs": [{(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}],
               "num_warps": 4}
    fn = types.SimpleNamespace(name="_kernel")
    assert _signature(dict(compile=compile, fn=fn, repr="r")) == \
        "_kernel[num_warps=4](x_ptr: *bf16 %16, N: i32, K: i32 %16; BLOCK=64)"
    assert _signature(dict(compile={}, fn=fn, repr="r")) == "r"
