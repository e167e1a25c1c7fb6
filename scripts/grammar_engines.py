"""Compare the grammar engines the server could constrain decoding with: llguidance and xgrammar.

For each engine and tokenizer (the byte tokenizer of the random presets, and a byte-level BPE of
VOCAB ids trained here on the standard library, the size class of a real checkpoint's), it times:
compiling a tool's JSON schema; the token mask of one decode step at batch 1 and at batch 64 (64
matchers at different points of a valid output, filled into one bitmask, each engine's batched
call); consuming a sampled token. Two correctness checks: whether the engine can require one of the
chat template's special tokens (`<|tool_call|>`), which the template grammar needs, and whether a
JSON string with a `maxLength` refuses raw control characters (JSON forbids them). The chosen engine
is in docs/decisions.md #33; the results are in runs/grammar-engines/.

    pip install llguidance xgrammar
    python scripts/grammar_engines.py runs/grammar-engines
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from beam_model.tokenizer import SPECIAL_TOKENS, HFTokenizer, save_hf_tokenizer  # noqa: E402

VOCAB = 32768
BATCH = 64
REPEATS = 5

SCHEMA = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "hourly": {"type": "boolean"},
        "fields": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 6},
        "at": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
               "required": ["lat", "lon"], "additionalProperties": False},
    },
    "required": ["location", "unit", "days"],
    "additionalProperties": False,
}
OUTPUT = json.dumps({"location": "San Francisco, California", "unit": "celsius", "days": 7, "hourly": False,
                     "fields": ["temperature", "wind", "humidity", "rain"], "at": {"lat": 37.77, "lon": -122.42}},
                    separators=(",", ":"))


def bpe_tokenizer(folder: Path) -> Path:
    """A byte-level BPE of VOCAB ids over the standard library's .py files, Beam's special tokens added."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(str(p) for p in Path(json.__file__).parents[1].glob("*.py"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 2)


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: Path, eos: int):
        import llguidance

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer_json.read_text(), eos_token=eos)
        self.executor = llguidance.LLExecutor()
        self.vocab = self.tok.vocab_size

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        return lambda: self.llg.LLMatcher(self.tok, grammar)

    def mask(self, matchers, bitmask: np.ndarray) -> None:
        from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

        if len(matchers) == 1:
            fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def consume(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def special_token_required(self, token: str, token_id: int) -> bool:
        m = self.llg.LLMatcher(self.tok, self.llg.LLMatcher.grammar_from_lark(f"start: {token} \"x\""))
        bitmask = np.zeros((1, (self.vocab + 31) // 32), dtype=np.int32)
        self.mask([m], bitmask)
        return not m.is_error() and bool((bitmask[0, token_id // 32] >> (token_id % 32)) & 1)

    def bounded_string_matcher(self, prefix: bytes):
        schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}}}
        m = self.compile(schema)()
        for b in prefix:
            m.consume_token(self.tok.tokenize_bytes(bytes([b]))[0])
        return m


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: Path, eos: int):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
        self.vocab = len(hf)
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                   separators=(",", ":"))
        return lambda: self.xgr.GrammarMatcher(compiled)

    def mask(self, matchers, bitmask: np.ndarray) -> None:
        t = torch.from_numpy(bitmask)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(t, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, t)

    def consume(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def special_token_required(self, token: str, token_id: int) -> bool:
        compiled = self.compiler.compile_grammar(self.xgr.Grammar.from_ebnf(f'root ::= "{token}" "x"'))
        m = self.xgr.GrammarMatcher(compiled)
        bitmask = np.zeros((1, (self.vocab + 31) // 32), dtype=np.int32)
        self.mask([m], bitmask)
        return bool((bitmask[0, token_id // 32] >> (token_id % 32)) & 1)

    def bounded_string_matcher(self, prefix: bytes):
        schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}}}
        m = self.compile(schema)()
        m.accept_string(prefix)
        return m


def control_characters_refused(engine, hf) -> bool:
    """Inside a JSON string with a maxLength, no token of a raw control character (U+0000-U+001F) is
    allowed (JSON forbids them unescaped)."""
    m = engine.bounded_string_matcher(b'{"a":"')
    bitmask = np.zeros((1, (engine.vocab + 31) // 32), dtype=np.int32)
    engine.mask([m], bitmask)
    controls = {hf.encode(chr(c), allow_special=False)[0] for c in range(32)}
    return not any((bitmask[0, t // 32] >> (t % 32)) & 1 for t in controls)


def measure(engine, tokens: list[int]) -> dict:
    compile_s, build = [], None
    for _ in range(REPEATS):
        started = time.perf_counter()
        build = engine.compile(SCHEMA)
        build()
        compile_s.append(time.perf_counter() - started)
    words = (engine.vocab + 31) // 32
    one = np.zeros((1, words), dtype=np.int32)
    step1, consume = [], []
    for _ in range(REPEATS):
        m = build()
        for t in tokens:
            started = time.perf_counter()
            engine.mask([m], one)
            step1.append(time.perf_counter() - started)
            if not (one[0, t // 32] >> (t % 32)) & 1:
                raise RuntimeError(f"{engine.name} masks out token {t} of a valid output")
            started = time.perf_counter()
            ok = engine.consume(m, t)
            consume.append(time.perf_counter() - started)
            assert ok, f"{engine.name} refused token {t}"
    many = np.zeros((BATCH, words), dtype=np.int32)
    step64 = []
    for _ in range(REPEATS):
        matchers = [build() for _ in range(BATCH)]
        for i, m in enumerate(matchers):  # spread over the output: row i starts i tokens in (mod its length)
            for t in tokens[:i % len(tokens)]:
                engine.consume(m, t)
        for k in range(len(tokens) // 2):
            started = time.perf_counter()
            engine.mask(matchers, many)
            step64.append(time.perf_counter() - started)
            for i, m in enumerate(matchers):
                pos = (i + k) % len(tokens)
                if pos + 1 < len(tokens):
                    engine.consume(m, tokens[pos])
                else:
                    matchers[i] = build()
    return {"compile_ms": round(statistics.median(compile_s) * 1e3, 3), "mask_b1_us": median_us(step1),
            "mask_b64_us": median_us(step64), "consume_us": median_us(consume), "tokens": len(tokens),
            "steps_timed_b1": len(step1), "steps_timed_b64": len(step64)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    tokenizers = {"byte-265": save_hf_tokenizer(tmp / "byte") / "tokenizer.json",
                  f"bpe-{VOCAB}": bpe_tokenizer(tmp / "bpe")}
    results = {}
    for tok_name, path in tokenizers.items():
        hf = HFTokenizer(path)
        tokens = hf.encode(OUTPUT, allow_special=False) + [hf.eos_token_id]
        for cls in (Llguidance, Xgrammar):
            engine = cls(path, hf.eos_token_id)
            row = measure(engine, tokens)
            row["requires_special_token"] = engine.special_token_required("<|tool_call|>",
                                                                          hf.special_ids["<|tool_call|>"])
            row["bounded_string_refuses_control_characters"] = control_characters_refused(engine, hf)
            results[f"{engine.name}/{tok_name}"] = row
            print(engine.name, tok_name, row, flush=True)
    env = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
           **{name: version(name) for name in ("llguidance", "xgrammar", "torch")}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"env": env, "batch": BATCH, "schema": SCHEMA,
                                                       "output": OUTPUT, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
