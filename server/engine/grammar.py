"""Grammar-constrained decoding with llguidance: compile a request's structure, match its tokens, and
fill the token masks the `sample` point takes.

A request's structure is a Lark grammar in llguidance's dialect (`SamplingParams.structure`): the chat
template's special tokens are written as tokens (`<|tool_call|>`), never matched by text, JSON values
as `%json {schema}`; the API writes it (server/api/structures.py). A reasoning budget narrows the
grammar's mask (engine/reasoning_budget.py). `Grammars` is one per engine: the tokenizer's vocabulary read once, each
structure validated once (cached by its text). A mask row is `ceil(V/32)` int32 words over the
model's vocabulary (bit j of word i: token 32 i + j; padded ids never set), the `sample` contract's
`allowed`. llguidance was chosen over xgrammar, which is faster per mask, because xgrammar 0.2.9 lets
a length-bounded JSON string hold raw control characters (invalid JSON) and matches special tokens as
text (runs/grammar-engines/, docs/decisions.md #33). Must never touch the model or the device: the
model runner moves the masks.
"""

from __future__ import annotations

import re
import threading

import torch

from beam_model.chat_template import END_THINK, THINK
from server.engine.reasoning_budget import ReasoningBudget, Utf8Tails


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class _Vocabulary:
    """The tokenizer as llguidance reads it (its TokenizerWrapper protocol): each id's bytes, padded
    with empty tokens to the model's vocabulary, the template's special tokens marked special."""

    bos_token_id = None

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.tokens = (tokenizer.token_bytes() + [b""] * vocab_size)[:vocab_size]
        self.special_token_ids = sorted(tokenizer.special_ids.values())

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, allow_special=False)


def _reason(error: str) -> str:
    """llguidance's error without what only the server wrote: the position in the grammar text the
    server made from the request, and that text's listing (which the client never sent)."""
    return re.sub(r"^at \d+\(\d+\): ", "", error.strip().splitlines()[0])


class Grammars:
    """The engine's grammar compiler over `tokenizer` (a ByteTokenizer or a byte-level HFTokenizer)
    and the model's `vocab_size`."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance  # imported here: a server that never constrains never loads it

        self._llg = llguidance
        self._vocabulary = _Vocabulary(tokenizer, vocab_size)
        self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(self._vocabulary))
        self._markers = (tokenizer.special_ids[THINK], tokenizer.special_ids[END_THINK])
        self._tails = None  # the vocabulary's UTF-8 tails, made for the first reasoning budget
        self._executor = None  # the parallel mask filler, made on first use (it starts threads)
        self._checked: dict[str, str] = {}  # structure -> llguidance's grammar text, once it validated
        self._lock = threading.Lock()  # compiling runs on the API's threads and the engine's

    def compile(self, structure: str) -> str:
        """The structure as llguidance's grammar, validated (cached); ValueError naming what is wrong."""
        with self._lock:
            grammar = self._checked.get(structure)
        if grammar is not None:
            return grammar
        grammar = self._llg.LLMatcher.grammar_from_lark(structure)
        error = self._llg.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ValueError(f"the output structure cannot be compiled: {_reason(error)}")
        with self._lock:
            self._checked[structure] = grammar
        return grammar

    def matcher(self, structure: str, thinking_token_budget: int | None = None) -> "Matcher":
        m = self._llg.LLMatcher(self._tokenizer, self.compile(structure), log_level=0)
        if m.is_error():
            raise ValueError(f"the output structure cannot be compiled: {_reason(m.get_error())}")
        budget = None
        if thinking_token_budget is not None:
            if self._tails is None:
                self._tails = Utf8Tails(self._vocabulary.tokens)
            budget = ReasoningBudget(thinking_token_budget, *self._markers, self._tails)
        return Matcher(m, budget)

    def fill(self, rows: list[tuple[int, "Matcher"]], bitmask: torch.Tensor) -> None:
        """Write each (row, matcher)'s mask into `bitmask[row]` (a contiguous host [rows, words] int32
        tensor); other rows untouched."""
        if len(rows) == 1:
            row, m = rows[0]
            target = bitmask[row]
            m.llg.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)
        else:
            self._fill_many(rows, bitmask)
        for row, m in rows:
            if m.budget is not None:
                m.budget.restrict(bitmask[row])

    def _fill_many(self, rows: list[tuple[int, "Matcher"]], bitmask: torch.Tensor) -> None:
        if self._executor is None:
            self._executor = self._llg.LLExecutor()
        self._executor.unsafe_compute_mask_ptr([(m.llg, row) for row, m in rows], bitmask.data_ptr(),
                                               bitmask.shape[1] * 4, bitmask.shape[0])


class Matcher:
    """One request's position in its grammar (and in its reasoning budget, if it has one)."""

    def __init__(self, matcher, budget: ReasoningBudget | None = None):
        self.llg, self.budget = matcher, budget

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it (the request fails)."""
        if self.budget is not None:
            self.budget.accept(token_id)
        return self.llg.consume_token(token_id) and not self.llg.is_error()
