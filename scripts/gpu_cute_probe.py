"""Where do the CuTe DSL variants hang? One GPU command that answers it case by case.

`boundary:cute`'s first call never completed on the H200 (runs/check-tp8-backends/cute-gpu-tests.log:
the op gate waited in the first sync after it). Each case below runs in its own process with a time
limit, from a trivial CuTe kernel launched the way our variants launch theirs (from_dlpack views,
torch's current stream) to each variant's kernel at a few specialisations, so the first case that
hangs or fails says which part is at fault. With --blocking every launch is synchronous
(CUDA_LAUNCH_BLOCKING=1: a hang shows in the call itself); --wrap runs each case under a tool, e.g.
--wrap "compute-sanitizer --tool synccheck".

    python3 scripts/gpu_cute_probe.py [--timeout 60] [--blocking] [--wrap CMD] [--cases NAME ...]

Prints one line per case (ok, wrong, error, hung); a case's own output follows its line when it did
not pass. Needs CUDA and cutlass (the GPU bundle); CPU-only machines get one line saying so.
"""


import argparse
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (what it isolates, kernel, settings)
CASES = {
    "flashinfer-rmsnorm": ("FlashInfer's own CuTe DSL rmsnorm (its default norm backend): CuTe DSL on this "
                           "host at all", "flashinfer", {}),
    "copy": ("the launch path alone: a 32-thread copy kernel via from_dlpack and torch's stream", "copy", {}),
    "boundary-w1": ("one warp: no shared memory, no barrier", "boundary", dict(hidden=64, warps=1)),
    "boundary-w4": ("four warps at beam-tiny: the config that hung", "boundary", dict(hidden=64, warps=4)),
    "boundary-w4-last": ("the last site: no second norm", "boundary", dict(hidden=64, warps=4, last=True)),
    "boundary-w20-tp8": ("hidden 5120, one vector per thread", "boundary", dict(hidden=5120, warps=20)),
    "boundary-w4-rows8": ("8 rows: 8 CTAs", "boundary", dict(hidden=64, warps=4, rows=8)),
    "gemv": ("qkvg_proj:cute's GEMV, 1 row at beam-tiny", "gemv", dict(rows=1)),
}


def _copy_case():
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import from_dlpack

    @cute.kernel
    def copy_kernel(src: cute.Tensor, dst: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        dst[tidx] = src[tidx]

    @cute.jit
    def copy(src: cute.Tensor, dst: cute.Tensor, stream: cuda.CUstream):
        copy_kernel(src, dst).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    a = torch.arange(32, dtype=torch.float32, device="cuda")
    b = torch.zeros_like(a)
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    cute.compile(copy, from_dlpack(a), from_dlpack(b), stream)(from_dlpack(a), from_dlpack(b), stream)
    torch.cuda.synchronize()
    return torch.equal(a, b), "b != a"


def _flashinfer_case():
    import torch
    from flashinfer.norm import rmsnorm

    x = torch.randn(4, 5120, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(5120, device="cuda", dtype=torch.bfloat16) + 0.5
    got = rmsnorm(x, w, 1e-6)
    torch.cuda.synchronize()
    want = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float())
    err = ((got.float() - want).norm() / want.norm()).item()
    return err < 1e-2, f"relative error {err}"


def _boundary_case(hidden, warps, last=False, rows=1):
    import torch

    from beam_model.functional import residual_coefficients
    from workbench.registry import get
    from workbench.variants import _cute_boundary

    gen = torch.Generator().manual_seed(0)
    y = (3 * torch.randn(rows, hidden, generator=gen)).to("cuda", torch.bfloat16)
    h = torch.randn(rows, hidden, generator=gen).to("cuda", torch.bfloat16)
    w = {"post_norm": (1 + 0.1 * torch.randn(hidden, generator=gen)).to("cuda", torch.bfloat16),
         "next_norm": None if last else (1 + 0.1 * torch.randn(hidden, generator=gen)).to("cuda", torch.bfloat16),
         "residual": torch.tensor(residual_coefficients(51), dtype=torch.float32, device="cuda")}
    got = _cute_boundary.boundary(y, h, w["post_norm"], w["next_norm"], w["residual"], eps=1e-6, num_warps=warps)
    torch.cuda.synchronize()
    want = get("boundary", "torch").fn(y, h, w, eps=1e-6)
    errs = [((g.float() - r.float()).norm() / r.float().norm()).item()
            for g, r in zip(got, want) if g is not None and r is not None]
    return max(errs) < 1e-2, f"relative errors {errs}"


def _gemv_case(rows):
    import torch

    from workbench.variants import _cute_gemv

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 64, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(160, 64, generator=gen) / 8).to("cuda", torch.bfloat16)
    got = _cute_gemv.linear(x, w, rows_per_warp=2, num_warps=4, unroll=5)
    torch.cuda.synchronize()
    want = x.float() @ w.float().t()
    err = ((got.float() - want).norm() / want.norm()).item()
    return err < 1e-2, f"relative error {err}"


def run_case(name: str) -> int:
    _, kernel, settings = CASES[name]
    cases = {"flashinfer": _flashinfer_case, "copy": _copy_case, "boundary": _boundary_case, "gemv": _gemv_case}
    ok, detail = cases[kernel](**settings)
    print("ok" if ok else f"wrong: {detail}", flush=True)
    return 0 if ok else 3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    p.add_argument("--blocking", action="store_true", help="CUDA_LAUNCH_BLOCKING=1 in every case")
    p.add_argument("--wrap", default="", help="a command to run each case under (e.g. compute-sanitizer ...)")
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    args = p.parse_args()
    if args.case:
        return run_case(args.case)
    import importlib.util

    import torch

    missing = [what for what, absent in (("cutlass", importlib.util.find_spec("cutlass") is None),
                                         ("a CUDA device", not torch.cuda.is_available())) if absent]
    if missing:
        print(f"gpu_cute_probe: needs {' and '.join(missing)}")
        return 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    if args.blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    failures = 0
    for name in args.cases:
        cmd = [*shlex.split(args.wrap), sys.executable, "-X", "faulthandler", os.path.abspath(__file__),
               "--case", name]
        started = time.perf_counter()
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            out = (done.stdout + done.stderr).strip()
            verdict = "ok" if done.returncode == 0 else ("wrong" if done.returncode == 3 else f"error {done.returncode}")
        except subprocess.TimeoutExpired as e:
            out = ((e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")).strip()
            verdict = f"hung (killed after {args.timeout:.0f} s)"
        failures += verdict != "ok"
        print(f"{name:18} {verdict:28} {time.perf_counter() - started:6.1f} s  {CASES[name][0]}", flush=True)
        if verdict != "ok" and out:
            print("    " + out[-3000:].replace("\n", "\n    "), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
