"""The run folder of `workbench optimize`: where each of its files lives, and how they are written and read.

A run folder holds everything a run claims (`profile.json`, `search/<point>.json`, `end_to_end.json`,
`lock.yaml`, `report.json`, ...). Each JSON file is written whole or not at all (`write_json`), so a
run ended by a time limit or a crash keeps the files it had; files a later stage depends on carry the
key they were made for, and a resumed run reuses one only when its key is the same (`RunFolder.saved`).
`write_json` is the one way the harness writes a JSON file that a later process reads.

What it must never do: decide what a key holds (its makers do: the search, optimize), time or gate
anything, or read a file into anything but plain JSON values.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable


def write_json(path, obj, *, indent: int = 2) -> None:
    """`obj` as JSON at `path` (its folder made if missing), written whole or not at all: a process
    ended mid-write leaves the file it had, and no reader sees half a file. The temporary file is named
    after this process, so writers in two processes never write into each other's."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=indent, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def read_json(path) -> Any | None:
    """The JSON value at `path`, or None when the file is missing or is not JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def resume_key(key: dict) -> dict:
    """`key` as it reads back from a file (a tuple reads back as a list, a number key as a string), so
    that a key made now equals the same key saved by an earlier run."""
    return json.loads(json.dumps(key))


class RunFolder:
    """One run folder: its files' paths, and reading them back under a resume key."""

    PROFILE = "profile.json"                # the reference step's profile, keyed
    PROFILE_TRACE = "profile.trace.json"
    LOCKED_PROFILE = "locked_profile.json"  # the locked step's profile
    LOCKED_PROFILE_TRACE = "locked_profile.trace.json"
    COMPILE_BASELINES = "compile_baselines.json"  # whole-step torch.compile baselines, keyed
    END_TO_END = "end_to_end.json"          # the end-to-end stage: its journal, then its result, keyed
    IN_STEP = "in_step.json"
    ACROSS_RANKS = "across_ranks.json"      # the reference and locked steps on --tp ranks, keyed
    LOCK = "lock.yaml"
    REPORT = "report.json"
    REPORT_MD = "report.md"

    def __init__(self, root: str):
        self.root = str(root)

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def search_result(self, point: str) -> str:
        """A point's search result (`search.Search` writes and reads it)."""
        return self.path("search", f"{point}.json")

    def inflight(self, point: str) -> str:
        """The candidates of a point's search in flight (JSON, but not *.json: no point result)."""
        return self.path("search", f"{point}.inflight")

    def read(self, name: str) -> Any | None:
        return read_json(self.path(name))

    def write(self, name: str, obj, *, indent: int = 2) -> None:
        write_json(self.path(name), obj, indent=indent)

    def saved(self, name: str, key: dict, read: Callable[[dict], Any] = lambda saved: saved) -> Any | None:
        """`read` of file `name` when it was made for `key` (its "key" field), so that a resumed run
        skips the stage that made it; None when it is missing, made for another key, or unreadable."""
        saved = self.read(name)
        try:
            return read(saved) if isinstance(saved, dict) and saved.get("key") == key else None
        except (TypeError, KeyError):
            return None
