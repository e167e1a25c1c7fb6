"""Helpers shared by the Triton variants: the guarded triton import, `jit`, `round_to`, and
programmatic dependent launch (`pdl_launch`, `pdl_enter`, `pdl_release`, `pdl_wait`).

Imports without triton (then `triton` is None and no helper kernel exists): the variants register
either way and the registry reports the backend as unavailable. Never import a variant from here.
"""

import os

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

    class tl:  # noqa: N801 -- just enough for kernel signatures (tl.constexpr annotations) to evaluate
        constexpr = None

# `@jit` defines a kernel where triton is installed, and leaves a plain function where it is not.
jit = triton.jit if triton is not None else (lambda fn: fn)

def pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1): a block size that covers n."""
    return 1 << max(0, int(n) - 1).bit_length()


def gemv_config(bn, bk, split_k=1, warps=4, stages=1, bm=16, dot=False) -> dict:
    """A tuning config of `kernels.gemv.linear` (plain data: defined whether or not triton is installed)."""
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split_k, DOT=dot, num_warps=warps, num_stages=stages)


# Whether kernels run under the Triton interpreter (TRITON_INTERPRET is set before this import, see
# tests/conftest.py). The interpreter casts FP32 -> BF16 by truncation and its tl.dot multiplies
# BF16 operands as raw bits, so interpreted kernels work around both; compiled kernels never do.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if triton is not None:
    _INTERPRETED = tl.constexpr(INTERPRETED)

    @triton.jit
    def round_to(x, dtype: tl.constexpr):
        """FP32 `x` rounded to nearest-even in `dtype`, as torch's `.to(dtype)` rounds.

        On the GPU this is the plain cast (cvt.rn). The interpreter truncates FP32 -> BF16 instead, so
        there BF16 is rounded through the bits, letting CPU tests check the GPU's rounding."""
        if _INTERPRETED and dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return tl.where(x != x, x, bits.to(tl.float32, bitcast=True)).to(tl.bfloat16)
        else:
            return x.to(dtype)


def pdl_launch(pdl: bool) -> dict:
    """Launch arguments for a kernel that takes the `PDL` constexpr: with programmatic dependent
    launch the kernel may start while its predecessor runs, so the kernel must call `pdl_wait` (or
    `pdl_enter`) before it reads anything an earlier kernel wrote and before it writes anything;
    only weights (never written) may be read before. Both come from this one flag, so no kernel is
    launched early without waiting. Off under the interpreter, which has no grid dependency control
    (a "pdl" config then runs as its base config)."""
    on = bool(pdl) and not INTERPRETED
    return {"PDL": on, "launch_pdl": on}


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def pdl_release(PDL: tl.constexpr):
        """Let the next kernel launch now (its programs start and wait in `pdl_wait`)."""
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Wait until the previous kernel has finished and its writes are visible."""
        if PDL:
            gdc_wait()

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """The start of a kernel that reads nothing before its wait: release the next, then wait."""
        pdl_release(PDL)
        pdl_wait(PDL)
else:  # no kernel is compiled without triton; the name still imports, so point modules need no guard
    pdl_enter = None
