"""Grammar-constrained decoding in the engine, without HTTP: the token masks (`TokenMasks`, a row without a
grammar all ones), the `sample` reference under a mask that leaves one token, and the two-graph decode
path (emulated on the CPU by scripts/graph_decode_emulation.py): structured rows batched with
unconstrained ones decode to valid outputs while the unconstrained rows keep their greedy tokens, in
that batch and in every later one.

beam-tiny in FP32 on the CPU (random weights), the byte tokenizer (vocab 265, the model's 288).
"""

import importlib.util
import json
import os
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from beam_model.chat_template import encode_chat, parse_assistant
from beam_model.tokenizer import ByteTokenizer
from server.api import protocol, structures
from server.engine import Engine, SamplingParams
from server.engine.grammar import Grammars
from server.engine.token_masks import TokenMasks
from workbench.variants.sample import allowed_mask, pack_allowed, sample

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOK = ByteTokenizer()
VOCAB = 288  # beam-tiny's (padded) vocabulary
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
THING = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
         "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -5, "maximum": 5},
                        "tag": {"type": "string", "maxLength": 3}, "kind": {"enum": ["a", "b"]}}}
MOVE = {"type": "function", "function": {
    "name": "move", "parameters": {"type": "object", "additionalProperties": False, "required": ["dir", "steps"],
                                   "properties": {"dir": {"enum": ["north", "south", "east", "west"]},
                                                  "steps": {"type": "integer", "minimum": 1, "maximum": 9}}}}}






def free_prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 70)]


def emulated_graph_engine(model, monkeypatch):
    """An Engine whose decode "graphs" are scripts/graph_decode_emulation.py's (as in test_server_engine.py):
    the runner's graph inputs, the forward replayed eagerly, then the draw graph's `_draw` under the token
    masks' device buffer. Returns it and the kinds of its steps, each that drew outside after "eager draw"."""
    from server.engine import llm_engine

    spec = importlib.util.spec_from_file_location("graph_decode_emulation",
                                                  os.path.join(ROOT, "scripts", "graph_decode_emulation.py"))
    emulation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulation)
    monkeypatch.setattr(llm_engine, "ModelRunner", emulation._emulated_runner)
    engine = Engine(model, ByteTokenizer(), num_pages=64, cuda_graphs=True, max_num_seqs=4)
    monkeypatch.undo()
    steps = []
    masked = engine.runner._masked
    engine.runner._masked = lambda logits: steps.append("eager draw") or masked(logits)
    engine.step_observer = lambda kind, *_: steps.append(kind)
    return engine, steps


def eager_draws(steps: list[str]) -> list[str]:
    """The kinds of the steps that drew their tokens outside the graph."""
    return [kind for drew, kind in zip(steps, steps[1:]) if drew == "eager draw"]


def completion_request(prompt: str, schema: dict, temperature: float):
    params = SamplingParams(max_tokens=200, temperature=temperature, structure=structures.completion_structure(schema))
    return TOK.encode(prompt, allow_special=False), params


def chat_request(prompt: str, temperature: float, thinking_token_budget: int = 2):
    """A forced call of MOVE (one call, `thinking_token_budget` tokens of reasoning) as the API builds it."""
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "tools": [MOVE],
            "tool_choice": {"type": "function", "function": {"name": "move"}}, "parallel_tool_calls": False,
            "thinking_token_budget": thinking_token_budget, "temperature": temperature}
    req = protocol.parse_chat(body, ["m"])
    params = SamplingParams(max_tokens=200, temperature=temperature, structure=structures.chat_structure(req, "tools"),
                            thinking_token_budget=req.thinking_token_budget)
    return encode_chat(TOK, req.messages, req.tools), params


def json_of(ids: list[int]) -> object:
    assert ids[-1] == TOK.eos_token_id, TOK.decode(ids)  # the grammar ended the output
    return json.loads(TOK.decode(ids[:-1]))


def call_of(ids: list[int]) -> dict:
    parsed = parse_assistant(TOK.decode(ids))
    (call,) = parsed.tool_calls
    assert call.name == "move" and ids[-1] == TOK.eos_token_id
    arguments = json.loads(call.arguments_json)
    jsonschema.validate(arguments, MOVE["function"]["parameters"])
    return arguments


# ------------------------------------------------------------------ the two-graph decode path

def test_graph_decode_masks_structured_rows_and_leaves_the_others_greedy(model, monkeypatch):
    """Structured rows (a boolean, a forced call, an object; greedy and sampled) beside unconstrained greedy
    rows: every structured output is valid, drawn in the draw graph under its mask; the unconstrained rows
    give the eager engine's tokens for them alone, though rows shift as the short structured ones finish
    (a row that held a grammar's mask is all ones again). Then a structured row alone leaves its mask in
    the buffer: a later unconstrained batch still gives the eager tokens (the buffer is reset)."""
    free = free_prompts()
    eager = Engine(model, ByteTokenizer(), num_pages=64).generate(free, GREEDY)
    engine, steps = emulated_graph_engine(model, monkeypatch)
    boolean = completion_request("Is it? ", {"type": "boolean"}, 0.0)
    call = chat_request("Go north", 1.0)
    thing = completion_request("The thing: ", THING, 1.0)
    batch = [boolean, (free[0], GREEDY), call, (free[1], GREEDY)]
    out = engine.generate([p for p, _ in batch], [s for _, s in batch])
    assert isinstance(json_of(out[0]), bool) and len(out[0]) < GREEDY.max_tokens  # it ended first
    call_of(out[2])
    assert [out[1], out[3]] == eager
    assert steps.count("decode") >= max(map(len, out)) - 1 and "decode" not in eager_draws(steps)  # in the graph

    steps.clear()
    (alone,) = engine.generate([thing[0]], [thing[1]])
    jsonschema.validate(json_of(alone), THING)
    assert engine.runner.masks._dirty  # the last structured step's mask is still in the buffer
    assert engine.generate(free, GREEDY) == eager
    assert steps.count("decode") >= 2 * (GREEDY.max_tokens - 1) and "decode" not in eager_draws(steps)


def test_graph_decode_of_many_structured_rows_is_valid(model, monkeypatch):
    """A full graph batch of structured rows (the parallel mask fill), sampled at temperature 1, twice."""
    engine, _ = emulated_graph_engine(model, monkeypatch)
    for round in range(2):
        batch = [completion_request(f"{round} thing {i}: ", THING, 1.0) for i in range(2)]
        batch += [chat_request(f"move {round} {i}", 1.0) for i in range(2)]
        out = engine.generate([p for p, _ in batch], [s for _, s in batch])
        for ids in out[:2]:
            jsonschema.validate(json_of(ids), THING)
        for ids in out[2:]:
            call_of(ids)


# ------------------------------------------------------------------ token masks

def rows(masks: torch.Tensor) -> list[list[int]]:
    """Each mask row's allowed token ids."""
    return [r.nonzero().flatten().tolist() for r in allowed_mask(masks, VOCAB)]


def test_token_masks_rows_without_a_grammar_are_all_ones():
    grammars = Grammars(TOK, VOCAB)
    masks = TokenMasks(4, VOCAB, torch.device("cpu"))
    free = SimpleNamespace(matcher=None)
    boolean = structures.completion_structure({"type": "boolean"})
    assert masks.fill(grammars, [free, free]) is None  # the eager path: no mask at all
    assert masks.fill(grammars, [free, free], always=True).eq(-1).all()  # a graph reads all ones

    one = masks.fill(grammars, [free, SimpleNamespace(matcher=grammars.matcher(boolean)), free])
    assert one.shape == (3, (VOCAB + 31) // 32) and one[0].eq(-1).all() and one[2].eq(-1).all()
    assert rows(one)[1] == [ord("f"), ord("t")]
    done = grammars.matcher(boolean)
    assert all(done.accept(t) for t in b"true")
    two = masks.fill(grammars, [SimpleNamespace(matcher=done), free,
                                SimpleNamespace(matcher=grammars.matcher(boolean))])  # the parallel fill
    assert rows(two) == [[TOK.eos_token_id], list(range(VOCAB)), [ord("f"), ord("t")]]
    assert done.accept(TOK.eos_token_id) and not done.accept(ord("x"))

    assert masks.fill(grammars, [free]) is None  # eager again: the buffer's stale rows are not read
    again = masks.fill(grammars, [free, free, free], always=True)
    assert again.eq(-1).all() and masks.device_buffer.eq(-1).all()  # every row a grammar wrote is reset


@pytest.mark.parametrize("budget", [None, 1, 3])
def test_the_reasoning_can_only_close_on_a_character_boundary(budget):
    """Walk the chat grammar's reasoning taking the longest UTF-8 lead byte it allows, then continuation
    bytes, then ASCII: wherever it lets <|/think|> close the reasoning, the bytes so far are whole
    characters, and with a budget the walk ends on <|/think|> alone."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "thinking_token_budget": budget}
    grammars = Grammars(TOK, VOCAB)
    matcher = grammars.matcher(structures.chat_structure(protocol.parse_chat(body, ["m"]), "all"), budget)
    masks, end = TokenMasks(1, VOCAB, torch.device("cpu")), TOK.special_ids["<|/think|>"]
    assert matcher.accept(TOK.special_ids["<|think|>"])
    reasoning = []
    for _ in range(8):
        (allowed,) = rows(masks.fill(grammars, [SimpleNamespace(matcher=matcher)]))
        if end in allowed:
            bytes(reasoning).decode("utf-8")  # strict: no character cut
        taken = [t for group in (range(0xF0, 0xF5), range(0xE0, 0xF0), range(0xC2, 0xE0), range(0x80, 0xC0),
                                 range(0x20, 0x7F)) for t in group if t in allowed]
        if not taken:
            break
        reasoning.append(taken[0])
        assert matcher.accept(taken[0])
    assert allowed == [end] or budget is None


# ------------------------------------------------------------------ sample under a mask

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sample_under_a_one_token_mask_always_draws_it(temperature):
    """Whatever the logits and the filters (top_k 1, a tiny top_p), a row whose mask leaves one token
    draws it; tokens on a mask word's edges (bit 31 is the sign bit) included."""
    g = torch.Generator().manual_seed(1)
    n = 48
    logits = torch.randn(n, VOCAB, generator=g) * 8
    only = torch.randint(VOCAB, (n,), generator=g)
    only[:6] = torch.tensor([0, 31, 32, 63, 264, VOCAB - 1])
    only = torch.where(only == logits.argmax(-1), (only + 1) % VOCAB, only)  # never the row's argmax
    logits[6, only[6]] = -1e30  # the allowed token as unlikely as it gets
    keep = torch.zeros(n, VOCAB, dtype=torch.bool)
    keep[torch.arange(n), only] = True
    allowed = pack_allowed(keep)
    assert torch.equal(allowed_mask(allowed, VOCAB), keep)
    t = torch.full((n,), temperature)
    top_k = torch.tensor([0, 1, 5] * (n // 3))
    top_p = torch.tensor([1.0, 0.5, 1e-6, 1.0] * (n // 4))
    for seed in range(8):
        ids = sample(logits, t, top_k, top_p, generator=torch.Generator().manual_seed(seed), allowed=allowed)
        assert torch.equal(ids, only)
    assert not torch.equal(sample(logits, t, top_k, top_p, generator=torch.Generator().manual_seed(0)), only)


def test_a_budget_never_starts_a_character_it_cannot_finish_with_multibyte_tokens():
    """Tokens that split a character (as byte-level BPE's do): one owing a byte is allowed only while two
    tokens are left; the budget spent, only <|/think|>."""
    from server.engine.reasoning_budget import ReasoningBudget, Utf8Tails

    vocab = [b"a", "中".encode()[:2], "中".encode()[2:], "中".encode(), b"<|think|>", b"<|/think|>"]
    budget = ReasoningBudget(2, 4, 5, Utf8Tails(vocab))

    def allowed():
        row = torch.full((1,), -1, dtype=torch.int32)
        budget.restrict(row)
        return [t for t in range(len(vocab)) if (int(row[0]) >> t) & 1]

    budget.accept(4)
    assert allowed() == [0, 1, 2, 3, 4, 5]  # two left: the half character may start
    budget.accept(0)
    assert allowed() == [0, 2, 3, 4, 5]  # one left: not a token that owes a byte
    budget.accept(3)
    assert allowed() == [5]
    budget.accept(5)
    assert allowed() == list(range(6))  # past the reasoning: nothing narrowed
