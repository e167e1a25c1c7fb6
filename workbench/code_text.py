"""A module's code as text that one Python version writes as any other would: tokens without comments,
blank lines, layout or top-level tuning-config lists (`X_CONFIGS = ...`), one per line.

`lock.code_key` hashes it: a lock made on the GPU host (Python 3.12) must read the same key on a
laptop or CI (3.11), where `ast.dump`, which the key used first, spells the same tree differently.
Tokens agree across versions except f-strings, which 3.12 splits into pieces (PEP 701): they are
taken whole from the source here, as 3.11 gives them. Stdlib only.
"""

from __future__ import annotations

import ast
import io
import tokenize

_LAYOUT = {tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE, tokenize.ENDMARKER}
_DROPPED = {tokenize.COMMENT, tokenize.NL}


def is_config_list(node: ast.stmt) -> bool:
    """A top-level `X_CONFIGS = ...` (also annotated or augmented)."""
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return all(isinstance(t, ast.Name) and t.id.endswith("CONFIGS") for t in targets)


def code_text(source: str) -> str:
    skipped = {line for node in ast.parse(source).body if is_config_list(node)
               for line in range(node.lineno, node.end_lineno + 1)}
    lines = source.splitlines(keepends=True)
    out, depth, start = [], 0, None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        kind = tokenize.tok_name[tok.type]
        if tok.start[0] in skipped or tok.type in _DROPPED:
            continue
        if kind == "FSTRING_START":  # Python >= 3.12
            depth += 1
            start = start if depth > 1 else tok.start
        elif kind == "FSTRING_END":
            depth -= 1
            if depth == 0:
                out.append(_span(lines, start, tok.end))
        elif depth == 0:
            out.append(kind if tok.type in _LAYOUT else tok.string)
    return "\n".join(out)


def _span(lines: list[str], start: tuple[int, int], end: tuple[int, int]) -> str:
    """The source text from `start` to `end` ((row from 1, column) pairs, as tokenize gives them)."""
    (r0, c0), (r1, c1) = start, end
    if r0 == r1:
        return lines[r0 - 1][c0:c1]
    return lines[r0 - 1][c0:] + "".join(lines[r0:r1 - 1]) + lines[r1 - 1][:c1]
