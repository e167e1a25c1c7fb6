"""TEST-ONLY hook: a scripted "model" that forces chosen replies, so tests can drive the reasoning,
tool-call and error paths end to end (random weights never emit well-formed markup).

The real model still runs every step (pages, batching and the cache are exercised as usual); this
hook then rewrites the logits of matching rows so one token wins. A script is a JSON list of rules:
    {"when": "substring of the decoded prompt", "reply": "text incl. <|special|> tokens",
     "fail_at": 3}   # optional: raise inside the step that would produce output token 3
The first rule whose `when` occurs in the prompt applies; the reply is followed by `<|end|>`.
Rows whose prompt matches no rule keep the model's logits. Enabled only by the hidden
`workbench serve --fake-model-script FILE` flag or by passing `logits_hook=` to `Engine`; never
imported by the serving code otherwise.
"""

from __future__ import annotations

import json
import weakref


class ScriptedLogits:
    def __init__(self, tokenizer, rules: list[dict]):
        self.tokenizer = tokenizer
        self.rules = []
        for r in rules:
            reply = tokenizer.encode(r["reply"]) + [tokenizer.eos_token_id]
            self.rules.append((r["when"], reply, r.get("fail_at")))
        self._match: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def from_file(cls, tokenizer, path: str) -> "ScriptedLogits":
        with open(path) as f:
            return cls(tokenizer, json.load(f))

    def _rule(self, seq):
        if seq not in self._match:
            prompt = self.tokenizer.decode(seq.token_ids[:seq.num_prompt_tokens])
            self._match[seq] = next((r for r in self.rules if r[0] in prompt), None)
        return self._match[seq]

    def __call__(self, seqs, logits) -> None:
        for row, seq in enumerate(seqs):
            rule = self._rule(seq)
            if rule is None:
                continue
            _, reply, fail_at = rule
            k = seq.num_output_tokens  # index of the token being chosen now
            if fail_at is not None and k >= fail_at:
                raise RuntimeError(f"scripted failure at output token {k}")
            if k < len(reply):
                logits[row] = float("-inf")
                logits[row, reply[k]] = 0.0
