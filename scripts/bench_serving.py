"""Run SGLang's serving benchmark client (`python -m sglang.bench_serving`, unmodified) against any
OpenAI-compatible endpoint, without importing the SGLang runtime.

`sglang/__init__.py` and `sglang/srt/utils/__init__.py` import the whole SGLang server stack (its
kernels, torch extensions, IPython, ...), none of which the benchmark client uses. This launcher
registers those two packages as empty package objects over their real folders, so only the
client's own modules load (sglang.bench_serving, sglang.benchmark.*, sglang.srt.utils.network:
aiohttp, numpy, requests, tqdm, transformers, datasets, pybase64, pillow, psutil, pyzmq), then runs
`sglang.bench_serving` as `__main__` with the given arguments. If `datasets` does not import, a
stand-in whose load_dataset raises takes its place (the random dataset never calls it). Nothing of
SGLang is copied here.

Usage: python scripts/bench_serving.py --backend vllm --base-url http://127.0.0.1:8000 ...
(any `sglang.bench_serving` argument; see `--help`).
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
import types


def _bare_package(name: str, folder: str) -> None:
    pkg = types.ModuleType(name)
    pkg.__path__ = [folder]
    pkg.__file__ = None
    pkg.__package__ = name
    sys.modules[name] = pkg


def main() -> None:
    spec = importlib.util.find_spec("sglang")  # finds the folder without running sglang/__init__.py
    if spec is None or not spec.submodule_search_locations:
        sys.exit("sglang is not importable: install the sglang wheel with --no-deps (see scripts/gpu_serve_sweep.sh)")
    root = list(spec.submodule_search_locations)[0]
    _bare_package("sglang", root)
    _bare_package("sglang.srt.utils", os.path.join(root, "srt", "utils"))
    try:  # only the Hugging Face-hosted datasets (MMMU, LongBench) use it; the random dataset does not
        importlib.import_module("datasets")
    except Exception as e:  # noqa: BLE001 - e.g. a pyarrow older than it wants
        why = f"{type(e).__name__}: {e}"
        print(f"bench_serving.py: `datasets` does not import ({why}); datasets that need it will fail",
              file=sys.stderr)
        stub = types.ModuleType("datasets")

        def load_dataset(*a, **k):
            raise RuntimeError(f"the datasets package did not import: {why}")

        stub.load_dataset = load_dataset
        sys.modules["datasets"] = stub
    sys.argv[0] = "sglang.bench_serving"
    runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
