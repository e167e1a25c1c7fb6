"""The training corpus: the `.py` files of the running interpreter's standard library.

Files are found under `sysconfig.get_paths()["stdlib"]` and named by their path relative to it, with
"/" separators (`email/parser.py`). Left out: anything under a `site-packages` or `dist-packages`
folder (installed packages, not the standard library); the test suites (every file under a folder named
`test`, `tests` or `idle_test`, e.g. the `test` package: about 19 MB of deliberately odd inputs, more
than the 12 MB of library code on CPython 3.11, so leaving them out keeps training quick and the text
ordinary); and files that are not valid UTF-8 (a handful, all in test suites on 3.11).

The held-out split is fixed by the relative path alone: a file is held out when the first 8 bytes of
sha256(relative path, UTF-8), read as a big-endian integer, are < HELD_OUT_PERCENT modulo 100. So the
split is the same on every machine, for every run and every vocabulary size, and a file keeps its side
when other files are added or removed. Held-out files never reach training.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_PERCENT = 5
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
PACKAGE_DIRS = frozenset({"site-packages", "dist-packages"})


@dataclass(frozen=True)
class CorpusFile:
    relpath: str  # relative to the corpus root, "/"-separated
    path: Path

    @property
    def held_out(self) -> bool:
        return is_held_out(self.relpath)

    def read(self) -> str:
        return self.path.read_bytes().decode("utf-8")


def stdlib_root() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relpath: str) -> bool:
    """Whether a file (by its "/"-separated path relative to the corpus root) is in the held-out slice."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELD_OUT_PERCENT


def corpus_files(root: str | Path | None = None) -> list[CorpusFile]:
    """Every corpus file under `root` (default: the standard library), sorted by relative path."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    # the walk skips the folders left out instead of listing them (site-packages can hold more files
    # than the standard library: a second a call where torch is installed there)
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in PACKAGE_DIRS and d not in TEST_DIRS]
        for name in names:
            path = Path(folder, name)
            if not name.endswith(".py") or not path.is_file():
                continue
            try:
                path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                continue
            out.append(CorpusFile("/".join(path.relative_to(root).parts), path))
    return sorted(out, key=lambda f: f.relpath)


def split(files: list[CorpusFile]) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """(training files, held-out files), each in the given order."""
    return [f for f in files if not f.held_out], [f for f in files if f.held_out]
