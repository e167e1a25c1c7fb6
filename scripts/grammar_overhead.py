"""What grammar-constrained decoding adds to a decode step, at batch 1 and 64 (or --batches).

For each batch size, the serving engine decodes the same prompts twice: free, and with every row under
a JSON-schema grammar that lasts longer than the run (an array of at least 64 small objects), both
sampled at temperature 1, alternating REPEATS times. Per decode step it records the engine's wall time
and the host time spent filling masks (`TokenMasks.last_seconds`, overlapped with the forward on a
GPU); the medians go to OUT/results.json. On a GPU the decode steps are CUDA-graph replays (the draw
graph reads the masks).

    PYTHONPATH=. python scripts/grammar_overhead.py runs/grammar-overhead-cpu [--device cuda --preset ...]
        [--lock runs/optimize-decode-b1-beam-501b-tp8/lock.yaml [--force-lock]]

With `--lock` the step is the locked build's (as `workbench serve --lock` runs it), else the reference's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from beam_model.model import BeamForCausalLM  # noqa: E402
from beam_model.tokenizer import ByteTokenizer  # noqa: E402
from server.api.structures import completion_structure  # noqa: E402
from server.engine import Engine, SamplingParams  # noqa: E402
from workbench.dtypes import dtype_of  # noqa: E402
from workbench.lock import load_for_serving  # noqa: E402

ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "n": {"type": "integer"}},
        "required": ["name", "n"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 64}
REPEATS = 3


def decode_steps(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[tuple[float, float]]:
    """(wall seconds, mask seconds) of each decode step while every request runs."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    out = []
    while engine.has_unfinished():
        started = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - started
        if engine.last_step and engine.last_step[0] == "decode" and engine.last_step[1] == len(prompts):
            out.append((seconds, engine.runner.masks.last_seconds))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", default="beam-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=48, help="tokens generated per request")
    ap.add_argument("--lock", help="serve this lock's variants (verified as `workbench serve` does)")
    ap.add_argument("--force-lock", action="store_true", help="serve the lock even if it fails verification")
    args = ap.parse_args()
    model = BeamForCausalLM.from_preset(args.preset, seed=0, dtype=dtype_of(args.dtype), device=args.device)
    lock = load_for_serving(args.lock, force=args.force_lock, device=args.device) if args.lock else None
    variants = dict(variants=lock.selection, variant_configs=lock.configs) if lock else {}
    tokenizer = ByteTokenizer()
    results = {}
    env = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "device": args.device, "preset": args.preset,
           "dtype": args.dtype, "lock": args.lock, **{name: version(name) for name in ("torch", "llguidance")},
           "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}
    args.out.mkdir(parents=True, exist_ok=True)
    command = "PYTHONPATH=. python scripts/grammar_overhead.py " + " ".join(sys.argv[1:])
    for b in args.batches:
        gc.collect()  # the last batch size's engine (its KV pages and graphs) goes before the next one plans
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        engine = Engine(model, tokenizer, max_num_seqs=b, **variants)
        gen = torch.Generator().manual_seed(b)
        prompts = [torch.randint(0, 256, (24,), generator=gen).tolist() for _ in range(b)]
        free = SamplingParams(max_tokens=args.steps, temperature=1.0, ignore_eos=True)
        structured = SamplingParams(max_tokens=args.steps, temperature=1.0, structure=completion_structure(SCHEMA))
        decode_steps(engine, prompts, free)  # warm-up: kernels, graphs, the grammar compiler
        decode_steps(engine, prompts, structured)
        plain, masked = [], []
        for _ in range(REPEATS):  # alternated, so that drift in the machine's speed hits both alike
            plain += decode_steps(engine, prompts, free)
            masked += decode_steps(engine, prompts, structured)
        step_free = statistics.median(s for s, _ in plain)
        step_masked = statistics.median(s for s, _ in masked)
        results[f"b{b}"] = {"decode_steps": [len(plain), len(masked)], "step_free_ms": round(step_free * 1e3, 3),
                            "step_structured_ms": round(step_masked * 1e3, 3),
                            "mask_fill_ms": round(statistics.median(m for _, m in masked) * 1e3, 3),
                            "overhead_ms": round((step_masked - step_free) * 1e3, 3),
                            "overhead_fraction": round(step_masked / step_free - 1, 4)}
        print(b, results[f"b{b}"], flush=True)
        # Written after each batch size, so a command that runs out of time keeps the sizes it finished.
        (args.out / "results.json").write_text(json.dumps({"command": command, "env": env, "schema": SCHEMA,
                                                           "steps": args.steps, "results": results}, indent=2) + "\n")
        del engine
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
