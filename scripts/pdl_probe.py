"""Does programmatic dependent launch (PDL) pay on this GPU for a decode-like chain of GEMVs?

A chain of N batch-1 GEMVs (each reads the last one's output and its own weight, weights together
larger than L2) is captured in one CUDA graph three ways: plain launches; launched with PDL, each
kernel waiting (griddepcontrol.wait) before any load and releasing its successor at once; and the
same, with each program's first weight tile loaded before the wait (weights are never written, so
they may be read while the previous kernel still runs). Prints and writes the time per kernel.

Usage (GPU host): python3 scripts/pdl_probe.py OUT.json [--n 256] [--rows 2048] [--cols 2048]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PDL: tl.constexpr, PREFETCH: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None] * K + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    if PREFETCH:
        w0 = tl.load(w_ptrs)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH and k0 == 0:
            w = w0
        else:
            w = tl.load(w_ptrs + k0)
        x = tl.load(x_ptr + k0 + offs_k)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + offs_n, tl.sum(acc, axis=1).to(tl.bfloat16))


def _time_graph(graph, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    dim = args.rows
    assert args.rows == args.cols, "a chain needs square weights"
    distinct = max(1, (512 << 20) // (dim * dim * 2))  # > L2 (50 MB) in total, reused round robin
    weights = [torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16) / dim ** 0.5 for _ in range(distinct)]
    acts = [torch.randn(dim, device="cuda", dtype=torch.bfloat16) for _ in range(args.n + 1)]
    results = {"n": args.n, "rows": dim, "cols": dim, "weights_mb": dim * dim * 2 / 1e6,
               "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "modes": {}}
    outputs = {}
    for block_n, block_k, warps in ((16, 256, 4), (8, 512, 2)):
        for mode, pdl, prefetch in (("plain", False, False), ("pdl", True, False),
                                    ("pdl+prefetch", True, True)):
            def chain():
                for i in range(args.n):
                    _gemv[(dim // block_n,)](acts[i], weights[i % distinct], acts[i + 1], dim, K=dim,
                                             BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl,
                                             PREFETCH=prefetch, num_warps=warps, launch_pdl=pdl)
            chain()  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain()
            graph.replay()
            torch.cuda.synchronize()
            ms = _time_graph(graph, args.reps)
            name = f"{mode} tile {block_n}x{block_k} w{warps}"
            outputs.setdefault((block_n, block_k), []).append(acts[-1].float().clone())
            results["modes"][name] = {"step_ms": ms, "us_per_kernel": ms * 1e3 / args.n,
                                      "floor_us_per_kernel": dim * dim * 2 / 4.3e6}
            print(f"{name:32s} {ms * 1e3 / args.n:7.2f} us/kernel", flush=True)
    # Same tile, same sums: PDL must not change a bit of the chain's result.
    results["outputs_agree"] = all(torch.equal(outs[0], o) for outs in outputs.values() for o in outs)
    print("outputs agree across modes:", results["outputs_agree"])
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
