"""A module's code as text that one Python version writes as any other would: tokens without comments,
docstrings, blank lines, layout or (optionally) top-level tuning-config lists (`X_CONFIGS = ...`), one
per line: what the module runs, not what it says to readers.

The lock's keys hash it: a lock made on the GPU host's Python must read the same key on another
version (3.11 in CI). Tokens agree across versions except f-strings, which 3.12 splits into pieces
(PEP 701): they are taken whole from the source here. Stdlib only.
"""

from __future__ import annotations

import ast
import io
import tokenize

_LAYOUT = {tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE, tokenize.ENDMARKER}
_DROPPED = {tokenize.COMMENT, tokenize.NL}
_BLOCKS = {tokenize.INDENT, tokenize.DEDENT}  # kept where a dropped docstring opens a block


def is_config_list(node: ast.stmt) -> bool:
    """A top-level `X_CONFIGS = ...` (also annotated or augmented)."""
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return all(isinstance(t, ast.Name) and t.id.endswith("CONFIGS") for t in targets)


def docstring(node: ast.AST) -> ast.Expr | None:
    """The docstring statement of a module, class or function node, or None."""
    body = getattr(node, "body", None) if isinstance(
        node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else None
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first
    return None


def _docstrings(tree: ast.Module):
    """The docstring statements of a module, its classes and functions."""
    return [doc for node in ast.walk(tree) if (doc := docstring(node)) is not None]


def code_text(source: str, *, configs: bool = False) -> str:
    """The module's tokens, one a line; tuning-config lists are kept only with `configs`."""
    tree = ast.parse(source)
    dropped = list(_docstrings(tree)) + ([] if configs else [n for n in tree.body if is_config_list(n)])
    skipped = {line for node in dropped for line in range(node.lineno, node.end_lineno + 1)}
    lines = source.splitlines(keepends=True)
    out, depth, start = [], 0, None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        kind = tokenize.tok_name[tok.type]
        if (tok.start[0] in skipped and tok.type not in _BLOCKS) or tok.type in _DROPPED:
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
