"""Speculative decoding with a DFlash drafter in the engine: whatever the drafts, greedy output is the
target's own token for token (under continuous batching, across pages, with rejected drafts rolled
back); sampled output follows the target's distribution (rejection sampling); a trained drafter's drafts
are kept. beam-tiny (random, FP32) for the engine's paths; the committed beam-mini and its drafter for
real acceptance.
"""

import logging
import os
import random
from types import SimpleNamespace

import pytest
import torch

from beam_model.config import FULL, SLIDING
from beam_model.drafter_config import DrafterConfig
from beam_model.model import BeamForCausalLM
from server.engine import Engine, SamplingParams
from server.engine.block_manager import BlockManager
from server.engine.speculative import Speculator, accept
from tests.server.test_server_engine import FullVocabTokenizer, prompts, seq
from workbench.training.drafter import initial_drafter
from workbench.variants.sample import contract_probs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINI, MINI_DRAFTER = os.path.join(ROOT, "models", "beam-mini"), os.path.join(ROOT, "models", "beam-mini-drafter")
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    model = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32)
    drafter = initial_drafter(DrafterConfig.for_target(model.config, num_hidden_layers=1, block_size=8), model,
                              seed=0, device="cpu")
    return model, drafter


def test_greedy_output_is_the_targets_whatever_the_drafts(tiny, monkeypatch):
    """Drafts that are the target's true continuation with one token spoiled at a random place (or none):
    every verify step keeps a different number of them, and the output is still the target's."""
    model, drafter = tiny
    tok, ps = FullVocabTokenizer(), prompts([5, 70, 130, 9], seed=3)
    greedy = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)  # the second reaches a new page
    plain = Engine(model, tok, num_pages=64).generate(ps, greedy)
    truth = {tuple(p): out for p, out in zip(ps, plain)}
    rng = random.Random(0)

    def oracle(self, items):
        for s, _, _ in items:
            done = s.num_output_tokens
            known = truth.get(tuple(s.token_ids[:s.num_prompt_tokens]), [])
            ids = (known[done:done + self.k] + [0] * self.k)[:self.k]
            spoil = rng.randrange(self.k + 2)
            if spoil < self.k:
                ids[spoil] = (ids[spoil] + 1) % 256
            s.draft.ids, s.draft.probs, s.draft.confidence = ids, None, [1.0] * self.k

    monkeypatch.setattr(Speculator, "_propose", oracle)
    engine = Engine(model, tok, num_pages=64, max_num_batched_tokens=64, drafter=drafter, num_speculative_tokens=7)
    assert engine.generate(ps, greedy) == plain
    stats = engine.speculator.stats
    assert stats.accepted > 0 and sum(1 for n in stats.histogram if n) >= 4, stats
    assert engine.block_manager.used(FULL) == 0 and engine.block_manager.used(SLIDING) == 0
    # every page offered to the prefix cache holds the right tokens: the prompt and its output again hit all
    whole = ps[1] + plain[1]
    assert len(whole) // 64 == 2
    hits = engine.scheduler.prefix_hit_tokens
    engine.generate([whole], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    assert engine.scheduler.prefix_hit_tokens - hits == (len(whole) - 1) // 64 * 64
    # a prompt that starts with another's cached pages: its drafter context begins after them
    again = ps[2][:128] + [7, 8, 9]
    truth[tuple(again)] = Engine(model, tok, num_pages=64).generate([again], greedy)[0]
    assert engine.generate([again], greedy) == [truth[tuple(again)]]
    assert engine.scheduler.prefix_hit_tokens >= 64


def _with_logprobs(engine, prompts_, params):
    """Each prompt's emitted TokenLogprobs, served together."""
    out = {f"r{i}": [] for i in range(len(prompts_))}
    for i, p in enumerate(prompts_):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.logprobs or []
    return list(out.values())


def test_a_logprobs_request_is_drafted_and_its_logprobs_are_the_targets(tiny, monkeypatch):
    """Kept drafts and bonus tokens carry the target's logprobs at their rows of the verify step (and
    its top alternatives), as a drafter-less engine reports them one step at a time."""
    model, drafter = tiny
    tok, ps = FullVocabTokenizer(), prompts([5, 40], seed=6)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
    plain = _with_logprobs(Engine(model, tok, num_pages=32), ps, params)
    truth = {tuple(p): [t.token_id for t in out] for p, out in zip(ps, plain)}

    def oracle(self, items):  # the true continuation after the last token (at `pos`), its third draft spoiled
        for s, _, pos in items:
            done = pos - s.num_prompt_tokens + 1
            ids = (truth[tuple(s.token_ids[:s.num_prompt_tokens])][done:done + self.k] + [0] * self.k)[:self.k]
            ids[2] = (ids[2] + 1) % 256
            s.draft.ids, s.draft.probs, s.draft.confidence = ids, None, [1.0] * self.k

    monkeypatch.setattr(Speculator, "_propose", oracle)
    engine = Engine(model, tok, num_pages=32, drafter=drafter, num_speculative_tokens=4)
    drafted = _with_logprobs(engine, ps, params)
    assert engine.speculator.stats.accepted >= 2 * engine.speculator.stats.verify_steps - 2  # two kept a step
    for a, b in zip(drafted, plain):
        assert [t.token_id for t in a] == [t.token_id for t in b]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b)) < 1e-4
        assert all([i for i, _ in x.top] == [i for i, _ in y.top] and len(x.top) == 3 for x, y in zip(a, b))


def test_structured_requests_are_drafted_within_their_grammar(tiny, monkeypatch):
    """Requests with a grammar (a JSON schema; a forced tool call with a reasoning budget) get drafts
    drawn under their masks, each after the drafts before it, and the matcher set back after drafting:
    greedy outputs equal the drafter-less engine's, sampled ones are valid, and drafts are kept. The
    drafter's logits favour the true continuation except at every third position."""
    import jsonschema

    from beam_model.tokenizer import ByteTokenizer
    from tests.server.test_structured_engine import THING, call_of, chat_request, completion_request, json_of

    model, drafter = tiny
    greedy = [completion_request("A thing:", THING, 0.0), chat_request("Go north twice", 0.0, thinking_token_budget=9)]
    sampled = completion_request("Another:", THING, 1.0)
    plain = Engine(model, ByteTokenizer(), num_pages=64).generate(*map(list, zip(*greedy)))
    truth = {tuple(p): out for (p, _), out in zip(greedy, plain)}
    drafting = []
    propose = Speculator._propose

    def noting(self, items):
        drafting[:] = items
        return propose(self, items)

    def towards_truth(first, starts, context, valid, block_size=None):
        logits = torch.zeros(len(drafting), block_size - 1, 288)
        for j, (s, _, pos) in enumerate(drafting):
            done = pos - s.num_prompt_tokens + 1
            for i, t in enumerate(truth.get(tuple(s.token_ids[:s.num_prompt_tokens]), [])[done:done + block_size - 1]):
                logits[j, i, (t + 1) % 256 if i % 3 == 2 else t] = 10.0
        return logits

    monkeypatch.setattr(Speculator, "_propose", noting)
    monkeypatch.setattr(drafter, "block_logits", towards_truth)
    engine = Engine(model, ByteTokenizer(), num_pages=64, drafter=drafter, num_speculative_tokens=7)
    out = engine.generate([p for p, _ in greedy] + [sampled[0]], [sp for _, sp in greedy] + [sampled[1]])
    assert out[:2] == plain
    json_of(out[0]) and call_of(out[1])
    jsonschema.validate(json_of(out[2]), THING)
    stats = engine.speculator.stats
    assert stats.accepted >= stats.verify_steps, stats  # most steps keep the two drafts before a spoiled one


def test_a_random_drafter_changes_nothing(tiny):
    model, drafter = tiny
    tok, ps = FullVocabTokenizer(), prompts([12, 40], seed=5)
    plain = Engine(model, tok, num_pages=32).generate(ps, GREEDY)
    engine = Engine(model, tok, num_pages=32, drafter=drafter, num_speculative_tokens=3)
    assert engine.generate(ps, GREEDY) == plain and engine.speculator.stats.verify_steps > 0


def test_a_drafter_build_of_its_own_binds_the_drafters_points_only(tiny):
    """`serve --draft-lock`: the drafter's points run a lock's variants of their own, the target's its own."""
    model, drafter = tiny
    tok, ps = FullVocabTokenizer(), prompts([12], seed=6)
    plain = Engine(model, tok, num_pages=32).generate(ps, GREEDY)
    try:
        engine = Engine(model, tok, num_pages=32, drafter=drafter, num_speculative_tokens=3,
                        drafter_variants={"qkvg_proj": "packed"})
        assert drafter.ops.selection["qkvg_proj"] == "packed" and model.ops.selection["qkvg_proj"] == "torch"
        assert engine.generate(ps, GREEDY) == plain and engine.speculator.stats.verify_steps > 0
    finally:
        drafter.set_variants()  # the module's other tests share it


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 3, 1.0)])
def test_rejection_sampling_follows_the_targets_distribution(temperature, top_k, top_p):
    """The first token a verify step emits (a kept draft, or the token drawn at the rejection) is
    distributed as the target's distribution, for a drafter whose distribution differs from it."""
    gen = torch.Generator().manual_seed(0)
    target = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0], [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    q = torch.tensor([[0.05, 0.5, 0.2, 0.2, 0.04, 0.01]], dtype=torch.float64)
    p = contract_probs(target[:1], torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]))[0]
    n, counts = 20000, torch.zeros(6)
    drafts = torch.multinomial(q[0].float(), n, replacement=True, generator=gen).tolist()
    for d in drafts:
        kept, bonus = accept(target, [d], params, q, gen)
        counts[d if kept else bonus] += 1
    expected = p.float() * n
    live = expected > 0
    assert counts[~live].sum() == 0  # nothing outside the target's top-k / top-p
    chi2 = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    assert chi2 < 40.0, (chi2, counts.tolist(), expected.tolist())  # df <= 5: ~1e-7 for a right sampler


def test_a_seeded_sampled_request_is_reproducible(tiny):
    model, drafter = tiny
    tok, ps = FullVocabTokenizer(), prompts([20], seed=9)
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    runs = [Engine(model, tok, num_pages=16, drafter=drafter, num_speculative_tokens=4).generate(ps, params)
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0][0]) == 24


def pair_sampling(model, drafter, n: int, *, temperature: float, max_num_seqs: int):
    """(a 6-token prompt, its sampling at `temperature` and top-k 3 for 3 tokens, its n outputs without
    the drafter, an engine with the drafter proposing one draft a step)."""
    tok, (prompt,) = FullVocabTokenizer(), prompts([6], seed=4)
    params = SamplingParams(max_tokens=3, temperature=temperature, top_k=3, ignore_eos=True)
    common = dict(num_pages=8 * 64, max_num_seqs=max_num_seqs, max_num_batched_tokens=4096, prefix_caching=False)
    plain = Engine(model, tok, **common, seed=1).generate([prompt] * n, params)
    return prompt, params, plain, Engine(model, tok, **common, seed=2, drafter=drafter, num_speculative_tokens=1)


def assert_same_pairs(plain: list[list[int]], drafted: list[list[int]]) -> None:
    """The counts of each output's first two tokens agree between the two engines (a two-sample
    chi-square over the pairs seen at least 10 times: a right sampler passes with p ~ 1e-7 to spare)."""
    pairs = sorted({tuple(o[:2]) for o in plain + drafted})
    a = torch.tensor([sum(tuple(o[:2]) == pr for o in plain) for pr in pairs], dtype=torch.float64)
    b = torch.tensor([sum(tuple(o[:2]) == pr for o in drafted) for pr in pairs], dtype=torch.float64)
    keep = (a + b) >= 10
    chi2 = float((((a - b) ** 2) / (a + b))[keep].sum())
    df = int(keep.sum()) - 1
    assert 2 <= df <= 8 and chi2 < df + 6 * (2 * df) ** 0.5, (chi2, df, a.tolist(), b.tolist())


def test_sampled_tokens_after_a_verify_step_follow_the_targets_distribution(tiny):
    """Many copies of one prompt, each its first two tokens drawn at temperature 0.7 and top-k 3, with the
    (random) drafter and without: the second token comes out of a verify step (its draft kept or
    rejected), and the pairs' counts agree between the two engines (a two-sample chi-square)."""
    n = 3000
    prompt, params, plain, engine = pair_sampling(*tiny, n, temperature=0.7, max_num_seqs=1024)
    drafted = engine.generate([prompt] * n, params)
    assert engine.speculator.stats.verify_steps >= n
    assert_same_pairs(plain, drafted)


def test_the_fused_step_samples_the_targets_distribution(tiny, monkeypatch):
    """The same pairs of tokens through the fused verify and draft step (its body eagerly, as the GPU's
    graph runs it): rejection sampling and the draws on the device follow the target's distribution.
    The verify step's drafts come from the target's own top 3 with their probabilities reversed, so
    drafts are often kept and, after a rejection, only the residual max(p - q, 0) gives the right token."""
    assert_fused_sampling_follows_the_target(*tiny, monkeypatch)


@pytest.mark.gpu
def test_the_fused_step_samples_the_targets_distribution_with_its_kernels(monkeypatch):
    """The same on a GPU, where the step's distributions, draws and acceptance are Triton kernels
    (`server.engine.block_sampling`)."""
    model = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32, device="cuda")
    drafter = initial_drafter(DrafterConfig.for_target(model.config, num_hidden_layers=1, block_size=8), model,
                              seed=0, device="cuda")
    assert_fused_sampling_follows_the_target(model, drafter, monkeypatch)


def assert_fused_sampling_follows_the_target(model, drafter, monkeypatch):
    from server.engine.verify_draft import VerifyDraft

    gen = torch.Generator(model.device).manual_seed(1)

    def reversed_top3(self, items):
        logits = model.forward(torch.tensor([s.token_ids for s, _, _ in items], device=model.device))[:, -1]
        logits[:, 256:] = float("-inf")  # the padded vocabulary the engine never draws
        rows = len(items)
        p = contract_probs(logits, *(torch.full((rows,), v, device=model.device) for v in (1.5, 3, 1.0)))
        top = p.topk(3, dim=-1)
        q = torch.zeros_like(p).scatter_(1, top.indices, top.values.flip(-1))
        for j, (s, _, _) in enumerate(items):
            s.draft.ids = torch.multinomial(q[j].float(), self.k, replacement=True, generator=gen).tolist()
            s.draft.probs, s.draft.confidence = q[j].expand(self.k, -1), [1.0] * self.k

    monkeypatch.setattr(Speculator, "_propose", reversed_top3)
    n = 3000
    prompt, params, plain, engine = pair_sampling(model, drafter, n, temperature=1.5, max_num_seqs=128)
    engine.speculator.fused = VerifyDraft(engine.speculator, max_num_seqs=128, graph_max_len=64, graphs=False)
    # in waves of the batch size: no prompt joins a step of verifying sequences (such a step runs eagerly)
    drafted = [o for _ in range(n // 128) for o in engine.generate([prompt] * 128, params)]
    fused, stats = engine.speculator.fused, engine.speculator.stats
    assert fused.steps >= 2 * (n // 128) and stats.verify_steps == len(drafted)
    assert_same_pairs(plain, drafted)
    assert 100 < stats.accepted < len(drafted) - 100  # drafts both kept and rejected


def test_every_block_reads_its_sequences_own_context_from_the_pages(tiny, monkeypatch):
    """The drafter's keys live on the target's sliding pages, written as each position is computed (prompt
    chunks, verify rows kept or not, another request's cached prefix, a preempted sequence computed again)
    and read back through the page table past window releases: each block's logits equal the block over
    the window of features that a plain forward of the sequence's tokens gives."""
    from beam_model.drafter import BeamDrafter
    from beam_model.kv_cache import PagedKVCache

    model, drafter = tiny
    proposing, seen = [], []
    propose, block_logits = Speculator._propose, BeamDrafter.block_logits

    def noting(self, items):
        proposing[:] = [list(s.token_ids) for s, _, _ in items]
        return propose(self, items)

    def recorded(self, first, starts, context, block_size=None, fed=None):
        out = block_logits(self, first, starts, context, block_size, fed)
        seen.extend(zip(proposing, out))
        return out

    monkeypatch.setattr(Speculator, "_propose", noting)
    monkeypatch.setattr(BeamDrafter, "block_logits", recorded)
    tok, ps = FullVocabTokenizer(), prompts([150, 9, 70, 130, 17, 64, 200, 33], seed=5)
    # under pressure: a pool so small that sequences are preempted and computed again
    tight = Engine(model, tok, num_pages=6, max_num_batched_tokens=48, prefix_caching=False, drafter=drafter,
                   num_speculative_tokens=7)
    served = list(zip(ps, tight.generate(ps, GREEDY)))
    assert tight.scheduler.num_preemptions > 0
    engine = Engine(model, tok, num_pages=64, max_num_batched_tokens=64, drafter=drafter, num_speculative_tokens=7)
    again = ps[0][:128] + [7, 8, 9]  # served after the others: its first 128 tokens from the prefix cache
    served += list(zip(ps[:2], engine.generate(ps[:2], GREEDY))) + [(again, engine.generate([again], GREEDY)[0])]
    assert engine.scheduler.prefix_hit_tokens >= 128
    window, taps = drafter.config.sliding_window, tuple(drafter.config.target_layer_ids)
    s = seq(list(range(100)))  # the sliding pages keep what the drafter reads: a block at position 79
    engine.block_manager.allocate(s, 100)  # reads back to position 63, page 0's last
    s.num_computed = 63 + window
    engine.block_manager.release_window(s)
    assert s.pages[SLIDING][0] >= 0
    engine.block_manager.free(s)
    features = []
    for ids in (p + out for p, out in served):
        cache = PagedKVCache.for_sequences(model.config, [len(ids)], dtype=torch.float32)
        cache.add(0)
        _, tapped = model.step(torch.tensor(ids), cache, cache.prepare_step([0], [len(ids)]), taps=taps)
        features.append((ids, drafter.context_features(tapped)))
    for tokens, logits in seen:
        start = len(tokens) - 1  # the block starts at the last token
        feats = next(f for ids, f in features if ids[:len(tokens)] == tokens)
        m = min(start, window)
        context = torch.zeros(1, window, drafter.config.hidden_size)
        valid = torch.zeros(1, window, dtype=torch.bool)
        context[0, window - m:], valid[0, window - m:] = feats[start - m:start], True
        at = torch.tensor([start])
        with torch.no_grad():
            want = block_logits(drafter, torch.tensor([tokens[-1]]), at, drafter.context_kv(at, context, valid),
                                len(logits) + 1)
        torch.testing.assert_close(logits[None], want, rtol=1e-4, atol=1e-4)
    assert len(seen) >= len(served) * 5


def test_the_kv_budget_holds_the_drafters_store(tiny):
    """The drafter's keys sit on every sliding page and a page a drafted block: the default CPU budget
    holds the target's pools and the drafter's store together."""
    from server.engine.cache_sizing import CPU_KV_BYTES, page_bytes

    model, drafter = tiny
    engine = Engine(model, FullVocabTokenizer(), drafter=drafter, num_speculative_tokens=7)
    held = sum(t.numel() * t.element_size() for t in [*engine.runner.cache.storage.values(), *engine.speculator.store])
    full_page = page_bytes(model.config, FULL, model.dtype, 64)
    assert CPU_KV_BYTES - full_page < held <= CPU_KV_BYTES  # short of the budget by less than a page


def test_pages_of_rejected_drafts_go_back():
    bm = BlockManager({FULL: 8, SLIDING: 8}, page_size=64, window=16)
    s = seq(list(range(60)))
    bm.allocate(s, 60 + 10)  # the last token and drafts reach into a second page
    assert len(s.pages[FULL]) == 2 and bm.used(FULL) == 2
    s.num_computed = 63  # two drafts kept: the second page holds only rejected ones
    bm.trim(s)
    assert len(s.pages[FULL]) == len(s.pages[SLIDING]) == 1 and bm.used(FULL) == 1


def test_a_page_is_offered_to_the_prefix_cache_once_its_kept_drafts_are_tokens():
    from server.engine.block_manager import page_hash

    bm = BlockManager({FULL: 8, SLIDING: 8}, page_size=64, window=16)
    s = seq(list(range(62)))
    bm.allocate(s, 62 + 4)
    s.num_computed = 65  # the verify step computed the last token and 3 kept drafts, not yet appended
    bm.commit(s)
    assert s.page_hashes == []  # page 0's last tokens are not in the sequence yet
    s.token_ids += [62, 63, 64, 65]  # the engine appends the kept drafts and the bonus token
    bm.commit(s)
    assert s.page_hashes == [page_hash(b"", list(range(64)))]


def test_a_drafter_that_fails_leaves_the_requests_to_decode_without_drafts(tiny, monkeypatch, caplog):
    """A crash in the drafter is logged with its cause and costs nothing but the drafts: the output is
    the target's own."""
    model, drafter = tiny
    tok, ps = FullVocabTokenizer(), prompts([12, 40], seed=5)
    plain = Engine(model, tok, num_pages=32).generate(ps, GREEDY)

    def broken(*a, **kw):
        raise RuntimeError("planted drafter fault")

    monkeypatch.setattr(drafter, "block_logits", broken)
    engine = Engine(model, tok, num_pages=32, drafter=drafter, num_speculative_tokens=3)
    assert engine.generate(ps, GREEDY) == plain and engine.speculator.stats.verify_steps == 0
    assert "the drafter failed; 2 sequences go on without drafts" in caplog.text
    assert "planted drafter fault" in caplog.text


def test_fewer_speculative_tokens_keep_the_first_drafts_of_the_drafters_whole_block(tiny):
    """The drafter always runs the block it was trained at (a shorter one drafts far worse: the committed
    beam-mini drafter's card); K below its drafts verifies the first K of them."""
    model, drafter = tiny
    drafts = {}
    for k in (3, 7):
        engine = Engine(model, FullVocabTokenizer(), num_pages=16, drafter=drafter, num_speculative_tokens=k)
        engine.add_request("r", prompts([9], seed=5)[0], GREEDY)
        engine.step()  # the prompt's step: its first token, then the drafts after it
        drafts[k] = engine.requests["r"].draft.ids
    assert len(drafts[3]) == 3 and drafts[3] == drafts[7][:3]


def test_speculative_tokens_must_fit_the_block(tiny):
    model, drafter = tiny
    with pytest.raises(ValueError, match="num_speculative_tokens must be in 1..7"):
        Engine(model, FullVocabTokenizer(), num_pages=16, drafter=drafter, num_speculative_tokens=8)
    # the block's own keys take a page of the drafter's store; its context lives on sliding pages
    wide = initial_drafter(DrafterConfig.for_target(model.config, num_hidden_layers=1, block_size=80), model,
                           seed=0, device="cpu")
    with pytest.raises(ValueError, match=r"the drafter's block of 80 tokens does not fit a KV page \(64\)"):
        Engine(model, FullVocabTokenizer(), num_pages=16, drafter=wide, num_speculative_tokens=3)
    full_only = SimpleNamespace(page_size=64, model=SimpleNamespace(config=SimpleNamespace(layer_types=[FULL])))
    with pytest.raises(ValueError, match="no sliding-window layers"):
        Speculator(full_only, drafter, 3, max_num_seqs=1)


@pytest.fixture(scope="module")
def mini():
    """The committed beam-mini and its drafter (FP32), three held-out prompts and their greedy outputs."""
    if not os.path.isdir(MINI_DRAFTER):
        pytest.skip("no committed beam-mini drafter")
    from beam_model.drafter import BeamDrafter
    from beam_model.tokenizer import load_tokenizer
    from server.engine.acceptance import held_out_prompts

    target = BeamForCausalLM.from_pretrained(MINI, dtype=torch.float32)
    tok = load_tokenizer(MINI)
    asked = held_out_prompts(tok, 3, 48)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    return SimpleNamespace(target=target, drafter=BeamDrafter.from_pretrained(MINI_DRAFTER, target), tok=tok,
                           asked=asked, params=params, plain=Engine(target, tok, num_pages=16).generate(asked, params))


def test_the_trained_drafter_is_accepted_and_changes_no_greedy_token(mini):
    engine = Engine(mini.target, mini.tok, num_pages=16, drafter=mini.drafter)
    assert engine.generate(mini.asked, mini.params) == mini.plain
    untrained = Engine(mini.target, mini.tok, num_pages=16,
                       drafter=initial_drafter(mini.drafter.config, mini.target, seed=0, device="cpu"))
    assert untrained.generate(mini.asked, mini.params) == mini.plain
    kept, chance = engine.speculator.stats.accepted, untrained.speculator.stats.accepted
    assert kept >= 10 and kept > 5 * chance, (engine.speculator.stats, untrained.speculator.stats)


def test_the_fused_verify_and_draft_step_is_the_eager_one(mini, monkeypatch, caplog):
    """The body the GPU captures as one graph (decode-shaped verify rows, acceptance, context window and
    the next block on the device), run eagerly: the same drafts kept, step for step, under batching, as
    the eager speculative step, and the target's greedy output."""
    from server.engine.verify_draft import VerifyDraft

    eager = Engine(mini.target, mini.tok, num_pages=16, drafter=mini.drafter)
    fused = Engine(mini.target, mini.tok, num_pages=16, drafter=mini.drafter)
    step = fused.speculator.fused = VerifyDraft(fused.speculator, max_num_seqs=4, graph_max_len=256, graphs=False)
    batches, body = [], step._body
    monkeypatch.setattr(step, "_body", lambda b, w, meta, sampled: batches.append(b) or body(b, w, meta, sampled))
    assert eager.generate(mini.asked, mini.params) == mini.plain
    assert fused.generate(mini.asked, mini.params) == mini.plain
    assert not [r.message for r in caplog.records if r.levelno >= logging.WARNING]  # no step fell back
    assert step.steps > 10 and max(batches) == len(mini.asked), batches
    assert fused.speculator.stats == eager.speculator.stats
    assert fused.speculator.stats.accepted > 0


def test_a_batch_with_a_sampled_request_takes_the_sampling_body_and_keeps_greedy_output(mini, monkeypatch, caplog):
    """A step whose rows are all greedy takes the body without distributions; one with a sampled request
    among them takes the sampling body, and the greedy requests' outputs are still the target's own."""
    from server.engine.verify_draft import VerifyDraft

    engine = Engine(mini.target, mini.tok, num_pages=32, drafter=mini.drafter)
    fused = engine.speculator.fused = VerifyDraft(engine.speculator, max_num_seqs=4, graph_max_len=256, graphs=False)
    bodies, body = [], fused._body
    monkeypatch.setattr(fused, "_body", lambda b, w, meta, sampled: bodies.append((b, sampled)) or body(b, w, meta,
                                                                                                     sampled))
    for i, p in enumerate(mini.asked):
        engine.add_request(f"g{i}", p, mini.params)
    engine.add_request("s", mini.asked[0], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, ignore_eos=True))
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    assert [out[f"g{i}"] for i in range(len(mini.asked))] == mini.plain
    assert len(out["s"]) == 12
    assert not [r.message for r in caplog.records if r.levelno >= logging.WARNING]  # no step fell back
    assert (4, True) in bodies and (3, False) in bodies, bodies


def test_adaptive_verification_takes_the_fused_step_at_the_width_it_chose(mini, monkeypatch, caplog):
    """With adaptive verification the fused step's blocks are the narrowest captured width holding the
    drafts it chose (a width of 1 when none pay), and the output is still the target's own."""
    from server.engine.speculative import VerifyCost
    from server.engine.verify_draft import VerifyDraft

    engine = Engine(mini.target, mini.tok, num_pages=16, drafter=mini.drafter, adaptive_verification=True)
    fused = engine.speculator.fused = VerifyDraft(engine.speculator, max_num_seqs=4, graph_max_len=256, graphs=False)
    assert fused.widths == [1, 2, 4, 8, 16]
    widths, body = [], fused._body
    monkeypatch.setattr(fused, "_body", lambda b, w, meta, sampled: widths.append(w) or body(b, w, meta, sampled))
    costs = iter([(1.0, 0.05), (1.0, 1e-4)] * 1000)  # verifying costs much, then little: both widths chosen
    monkeypatch.setattr(VerifyCost, "coefficients", lambda self: next(costs))
    assert engine.generate(mini.asked, mini.params) == mini.plain
    assert not [r.message for r in caplog.records if r.levelno >= logging.WARNING]  # no step fell back
    assert fused.steps == len(widths) > 10 and len(set(widths)) >= 2 and min(widths) < 16, widths
    assert engine.speculator.stats.accepted > 0


def test_engines_sharing_a_model_bind_its_build_once():
    """A second engine given the build a model already runs keeps the model's (and the drafter's)
    prepared weights: the first engine's captured graphs read them, and binding prepares them anew."""
    model = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32)
    drafter = initial_drafter(DrafterConfig.for_target(model.config, num_hidden_layers=1, block_size=4), model,
                              seed=0, device="cpu")
    build = {"qkvg_proj": "packed"}
    Engine(model, FullVocabTokenizer(), num_pages=16, variants=build, drafter=drafter)
    prepared = [layer.prepared for layer in [*model.model.layers, *drafter.layers]]
    assert model.ops.selection["qkvg_proj"] == drafter.ops.selection["qkvg_proj"] == "packed"
    Engine(model, FullVocabTokenizer(), num_pages=16, variants=build, drafter=drafter)
    assert all(a is b.prepared for a, b in zip(prepared, [*model.model.layers, *drafter.layers]))
    Engine(model, FullVocabTokenizer(), num_pages=16, variants={}, drafter=drafter)  # another build: bound anew
    assert model.ops.selection["qkvg_proj"] == drafter.ops.selection["qkvg_proj"] == "torch"


def test_adaptive_verification_verifies_what_pays():
    from server.engine.speculative import VerifyCost, verified_drafts

    sure, unsure = [0.99] * 6, [0.9, 0.05, 0.9, 0.9]
    # a step costs 1 + 0.01 a token: a sure draft pays; a 5% draft (and those after it) does not
    assert verified_drafts([sure, unsure], 2, 2, (1.0, 0.01)) == [6, 1]
    assert verified_drafts([sure, unsure], 2, 2, (1.0, 0.0)) == [6, 4]   # free tokens: verify all
    assert verified_drafts([sure], 1, 1, (0.0, 1.0)) == [0]              # pure per-token cost: none pays
    cost = VerifyCost()
    assert cost.coefficients() == (1.0, 1.0 / VerifyCost.PRIOR_TOKENS)
    for tokens in (1, 8, 16, 1, 8, 16, 4, 2):
        cost.record(tokens, 0.5 + 0.25 * tokens)
    a, b = cost.coefficients()
    assert abs(a - 0.5) < 1e-9 and abs(b - 0.25) < 1e-9
    # the device's cost of a row, where measured, stands in for a slope fitted to the host's noise: here
    # steps of 1 and 2 tokens whose wall times differ by the host's jitter, not by the extra token
    cost = VerifyCost()
    for tokens, seconds in [(1, 0.90), (2, 0.97), (1, 0.88), (2, 0.95)] * 4:
        cost.record(tokens, seconds)
    assert cost.coefficients()[1] > 0.05  # a fitted slope: every draft looks as costly as 5% of a step
    flat = [0.05, 0.9, 0.9]  # a drafter whose first draft it holds at 5% (its top token, often right)
    assert verified_drafts([flat], 1, 1, cost.coefficients()) == [0]
    cost.per_token_s = 0.004
    a, b = cost.coefficients()
    assert b == 0.004 and abs(a - (0.925 - 0.004 * 1.5)) < 1e-9
    assert verified_drafts([flat], 1, 1, (a, b)) == [3]
    fresh = VerifyCost()
    fresh.per_token_s = 0.004
    assert fresh.coefficients() == (0.004 * VerifyCost.PRIOR_TOKENS, 0.004)
    free = VerifyCost()  # rows measured free before any step: every draft is worth verifying
    free.per_token_s = 0.0
    assert verified_drafts([sure], 1, 1, free.coefficients()) == [6]


def test_adaptive_verification_keeps_greedy_output(tiny):
    model, drafter = tiny
    tok, ps = FullVocabTokenizer(), prompts([12, 40, 75], seed=8)
    plain = Engine(model, tok, num_pages=32).generate(ps, GREEDY)
    engine = Engine(model, tok, num_pages=32, drafter=drafter, num_speculative_tokens=5, adaptive_verification=True)
    assert engine.generate(ps, GREEDY) == plain
    assert len(engine.speculator.cost.samples) > 0


def test_a_block_keeps_none_of_its_padding_rows():
    """A verify step's blocks as the graph reads them: a sequence with fewer drafts than the block is wide
    (adaptive verification, or near its end) can keep only its own drafts, one whose first token is at
    position 0 included, and a block of padding (a batch smaller than the graph's) none."""
    from types import SimpleNamespace

    from server.engine.block_manager import GROUPS
    from server.engine.graph_inputs import GraphInputs
    from server.engine.verify_draft import block_rows, keepable

    def seq(start, drafts):
        return SimpleNamespace(token_ids=list(range(start + 1)), draft=SimpleNamespace(ids=drafts),
                               pages={g: [1, 2] for g in GROUPS})

    seqs, starts, counts = [seq(20, [5, 6, 7]), seq(9, [8]), seq(0, [])], [20, 9, 0], [4, 2, 1]
    ids, positions, pages = block_rows(seqs, starts, counts, 4)
    inputs = GraphInputs(16, 2, GROUPS, torch.device("cpu"))
    inputs.fill(16, ids, positions, pages, 16)  # a fourth block of padding only
    assert keepable(inputs.pos[:16], 4, 4).tolist() == [3, 1, 0, 0]
    assert ids[:8] == [20, 5, 6, 7, 9, 8, 0, 0]
