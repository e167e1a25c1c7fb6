"""Provenance of a result: the machine, the libraries and the code it was measured with.

`environment()` is the record every result file carries (bench.json, lock.yaml, report.json): GPU,
driver, library versions, the git commit and the git tree of the files on disk, host and date. The
keys of the code a variant runs are `workbench.lock`'s (`source_hash`, `code_key`, `module_key`).

What it must never do: fail a run for want of git or nvidia-smi (a field it cannot read is None);
time, gate or write anything.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
import tempfile
from pathlib import Path

import torch

from workbench.timing import as_device, l2_bytes

ROOT = Path(__file__).resolve().parents[1]


def now() -> str:
    """The time in UTC to the second, as result files record it."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _run(cmd: list[str], *, cwd: Path = ROOT, env: dict | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=cwd, env=env)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def git_tree(cwd: Path = ROOT) -> str | None:
    """The git tree hash of the files as they are on disk (ignored files left out), built in a
    throwaway index: `git rev-parse COMMIT^{tree}` for a clean checkout of COMMIT. It names the code a
    result ran where `git_commit` cannot: the GPU host's copy of the tree carries a .git older than its
    files, so there the commit is stale and only "dirty" says so."""
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "GIT_INDEX_FILE": os.path.join(d, "index")}
        for step in (["read-tree", "HEAD"], ["add", "-A"]):
            if _run(["git", "--no-optional-locks", *step], cwd=cwd, env=env) is None:
                return None
        return _run(["git", "--no-optional-locks", "write-tree"], cwd=cwd, env=env)


def _version(dist: str, module: str) -> str | None:
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec(module) is None:
        return None
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "present"


def environment(device=None) -> dict:
    """What a result depends on: GPU, driver, library versions, git commit and tree, host, date."""
    cuda = torch.cuda.is_available()
    gpu = as_device(device if device is not None and torch.device(device).type == "cuda" else "cuda") if cuda else None
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    commit = _run(["git", "--no-optional-locks", "rev-parse", "HEAD"])
    status = _run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"])
    return {
        "gpu": torch.cuda.get_device_name(gpu) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "l2_bytes": l2_bytes(gpu) if cuda else None,
        "driver": smi.splitlines()[0] if smi else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _version("triton", "triton"),
        "flashinfer": _version("flashinfer-python", "flashinfer"),
        "cutlass": _version("nvidia-cutlass-dsl", "cutlass"),
        "python": platform.python_version(),
        "git_commit": commit,
        "git_dirty": bool(status) if status is not None else None,
        "git_tree": git_tree(),
        "hostname": socket.gethostname(),
        "date": now(),
    }
