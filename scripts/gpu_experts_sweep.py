"""Sweep `experts:triton`'s decode (GEMV) tuning space without editing the variant: one `workbench
bench experts --variants triton --gate --config ...` run, every config op-gated, then timed against
the reference in the same process (CUDA graphs, inputs larger than L2).

The two GEMV kernels are tuned apart: the gate/up tile (BLOCK_N ff rows x BLOCK_K hidden) is swept
with the default down tile, the down tile (DOWN_BLOCK_N hidden rows x DOWN_BLOCK_K ff) with the
default gate/up tile, and warps x stages (shared by both) on the default tiles. The winners of each
half, combined, are the configs to add to `experts.TRITON_CONFIGS` (re-lock after: it changes the
variant's source hash).

    python3 scripts/gpu_experts_sweep.py [--batch 1] [--preset beam-501b-tp8] [--out runs/NAME] [--device cuda]
"""

import argparse
import json
import subprocess
import sys

DEFAULT = dict(path="gemv", BLOCK_N=8, BLOCK_K=512, DOWN_BLOCK_N=16, DOWN_BLOCK_K=64, num_warps=4, num_stages=1)
GATE_UP = [(2, 1024), (2, 2048), (4, 512), (4, 1024), (4, 2048), (8, 256), (8, 1024), (16, 512)]
DOWN = [(4, 64), (4, 128), (8, 64), (8, 128), (16, 32), (32, 64)]
LAUNCH = [(w, s) for w in (2, 4, 8) for s in (1, 2, 3) if (w, s) != (4, 1)]


def configs() -> list[dict]:
    out = [{**DEFAULT, "BLOCK_N": n, "BLOCK_K": k} for n, k in GATE_UP]
    out += [{**DEFAULT, "DOWN_BLOCK_N": n, "DOWN_BLOCK_K": k} for n, k in DOWN]
    out += [{**DEFAULT, "num_warps": w, "num_stages": s} for w, s in LAUNCH]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--preset", default="beam-501b-tp8")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", help="bench.json and report.md here")
    args, timing = p.parse_known_args()  # anything else (--max-seconds ...) goes to `workbench bench`
    cmd = [sys.executable, "-m", "workbench.cli", "bench", "experts", "--variants", "triton", "--gate",
           "--preset", args.preset, "--batch", str(args.batch), "--dtype", args.dtype, "--device", args.device,
           *[a for c in configs() for a in ("--config", json.dumps(c))], *timing,
           *(["--out", args.out] if args.out else [])]
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
