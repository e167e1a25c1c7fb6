"""`boundary`: [all-reduce] -> post-norm -> depth-scaled residual -> next pre-norm.

Contract: `boundary(y, h, w, *, eps, group=None) -> (h_new, x_next)`.
- y [N, hidden]: the sub-layer's output (a partial sum per rank under tensor parallelism).
- h [N, hidden]: the residual stream, model dtype. Neither input is modified.
- w: {"post_norm": [hidden], "next_norm": [hidden] or None (after the last sub-layer),
  "residual": FP32 [2] = (a, b) of this site's depth-scaled add h <- a*h + b*y, from
  `residual_coefficients(k)` for the k-th add (k = 1..2*layers)}. Keeping the per-site constants
  in `w` gives all 104 sites one signature (one compiled graph, one kernel specialisation).
- eps: RMSNorm epsilon; group: TP process group (None on one GPU: no all-reduce).
Numerics: all-reduce in the model dtype; post-norm and the residual add in FP32, rounded once to
give h_new; x_next = RMSNorm(h_new as stored) in FP32, rounded once. None when next_norm is None.
"""

import torch
import torch.distributed as dist

from beam_model.functional import residual_coefficients, rms_norm
from workbench.points import Call, PointSpec, declare
from workbench.registry import register
from workbench.variants.inputs import DTYPE_BYTES, Rand


def _reduced(y, group):
    """y summed across the tensor-parallel group (a copy: y itself is never written); y without one.
    Every variant keeps this slot so a fused all-reduce can replace it later."""
    if group is None:
        return y
    y = y.clone()
    dist.all_reduce(y, group=group)
    return y


@register("boundary", "torch", "torch")
def boundary(y, h, w, *, eps, group=None):
    y = _reduced(y, group)
    a, b = w["residual"][0], w["residual"][1]
    h_new = (a * h.float() + b * rms_norm(y, w["post_norm"], eps)).to(h.dtype)
    if w["next_norm"] is None:
        return h_new, None
    return h_new, rms_norm(h_new, w["next_norm"], eps).to(h.dtype)


# ---- spec: inputs, roofline and tolerance for the harness ------------------------------------------


def _inputs(wl, device, seed):
    c, r = wl.config, Rand("boundary", wl, device, seed)
    hidden, n = c.hidden_size, wl.tokens
    # Any site but the last (no next norm there; captured calls of the last layer cover that case).
    k = 1 + seed % (c.num_residual_adds - 1)
    w = {"post_norm": r.norm(hidden), "next_norm": r.norm(hidden),
         "residual": torch.tensor(residual_coefficients(k), dtype=torch.float32, device=r.device)}
    return Call((r.normal(n, hidden), r.normal(n, hidden), w), dict(eps=c.rms_norm_eps), weights_arg=2)


declare(PointSpec(
    "boundary", _inputs,
    bytes=lambda wl: DTYPE_BYTES[wl.dtype] * (4 * wl.tokens + 2) * wl.config.hidden_size + 8,  # y, h in; h, x out
    flops=lambda wl: 12 * wl.tokens * wl.config.hidden_size,  # two norms + the scaled add, per element
    tolerance={"fp32": 1e-5, "fp16": 1e-3, "bf16": 8e-3},  # ~2.5x the reference's worst vs FP64
))


# ---- Triton: one kernel for the whole boundary ----------------------------------------------------
# Kernels are defined only when triton imports; the variant is registered either way and the registry
# reports the backend as unavailable.
import functools

from workbench.variants.kernels.triton_common import pdl_launch, triton

if triton is not None:
    import triton.language as tl

    from workbench.variants.kernels.triton_common import pdl_enter, round_to

    @triton.jit
    def _boundary_kernel(y_ptr, h_ptr, post_w_ptr, next_w_ptr, res_ptr, h_out_ptr, x_out_ptr,
                         y_stride, h_stride, out_stride, hidden, eps,
                         BLOCK: tl.constexpr, HAS_NEXT: tl.constexpr, PDL: tl.constexpr = False):
        """Post-norm of y, depth-scaled residual add and next pre-norm of one row, in one pass.

        The reference reads y, h and h_new back from memory across four kernels; here y and h are read
        once and h_new / x_next written once. h_new is rounded to the model dtype *before* the next
        norm reads it, since the reference's x_next is the norm of h_new as stored."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        # Weights (norms and the site's coefficients) are never written: with PDL they are read while
        # the previous kernel finishes; y and h only after the wait.
        w = tl.load(post_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(res_ptr)  # read on the device: no host sync, one specialisation for all 104 sites
        b = tl.load(res_ptr + 1)
        if HAS_NEXT:
            wn = tl.load(next_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        pdl_enter(PDL)
        y = tl.load(y_ptr + row * y_stride + cols, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + row * h_stride + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(y * y, axis=0) / hidden + eps)
        h_new = round_to(a * h + b * (y * r * w), h_out_ptr.dtype.element_ty)
        tl.store(h_out_ptr + row * out_stride + cols, h_new, mask=mask)
        if HAS_NEXT:
            hn = h_new.to(tl.float32)
            rn = tl.math.rsqrt(tl.sum(hn * hn, axis=0) / hidden + eps)
            x_next = round_to(hn * rn * wn, x_out_ptr.dtype.element_ty)
            tl.store(x_out_ptr + row * out_stride + cols, x_next, mask=mask)


_BOUNDARY_MAX_HIDDEN = 8192  # one row must fit one block of registers
_BOUNDARY_CONFIGS = [{"num_warps": 8}, {"num_warps": 16}, {"num_warps": 4}, {"num_warps": 32}]


def _boundary_triton_at(y, h, w, *, eps, group=None, num_warps=8, pdl=False):
    y = _reduced(y, group)
    y = y if y.stride(-1) == 1 else y.contiguous()
    h = h if h.stride(-1) == 1 else h.contiguous()
    n, hidden = h.shape
    h_new = torch.empty((n, hidden), dtype=h.dtype, device=h.device)
    nxt = w["next_norm"]
    x_next = None if nxt is None else torch.empty_like(h_new)
    if n:
        _boundary_kernel[(n,)](
            y, h, w["post_norm"], w["post_norm"] if nxt is None else nxt, w["residual"], h_new,
            h_new if x_next is None else x_next, y.stride(0), h.stride(0), h_new.stride(0), hidden, eps,
            BLOCK=triton.next_power_of_2(hidden), HAS_NEXT=nxt is not None, num_warps=num_warps,
            **pdl_launch(pdl))
    return h_new, x_next


def _boundary_triton_supports(workload):
    hidden = workload.config.hidden_size
    if workload.dtype not in ("bf16", "fp16", "fp32"):
        return f"dtype {workload.dtype} not handled (bf16, fp16, fp32)"
    if hidden > _BOUNDARY_MAX_HIDDEN:
        return f"hidden {hidden} > {_BOUNDARY_MAX_HIDDEN}: a row must fit one block"
    return True


@register("boundary", "triton", "triton", supports=_boundary_triton_supports, configs=_BOUNDARY_CONFIGS, pdl=True,
          configure=lambda cfg: functools.partial(_boundary_triton_at, **cfg))
def boundary_triton(y, h, w, *, eps, group=None):
    """One Triton kernel per row: RMSNorm(y) -> a*h + b*(.) -> round -> RMSNorm(h_new) -> round."""
    return _boundary_triton_at(y, h, w, eps=eps, group=group, **_BOUNDARY_CONFIGS[0])


# ---- CuTe DSL: the same one-row-per-CTA kernel, with 16-byte accesses ------------------------------
# The kernel (workbench/variants/kernels/cute_boundary.py) imports cutlass, so it is imported by the variant's
# first call; the variant is registered either way and the registry reports the backend as unavailable.
from workbench.variants.kernels.cute_common import vector_rows_supported  # noqa: E402

_CUTE_MAX_HIDDEN = 16384  # the row stays in registers between the two norms
# Threads per row; 20 warps give one vector per thread at hidden 5120 (beam-501b).
_BOUNDARY_CUTE_CONFIGS = [{"num_warps": 4}, {"num_warps": 8}, {"num_warps": 16}, {"num_warps": 20}]


def _boundary_cute_at(y, h, w, *, eps, group=None, num_warps=4):
    y = _reduced(y, group)
    from workbench.variants.kernels import cute_boundary as _cute_boundary

    return _cute_boundary.boundary(y, h, w["post_norm"], w["next_norm"], w["residual"], eps=eps, num_warps=num_warps)


def _boundary_cute_supports(workload):
    hidden = workload.config.hidden_size
    if hidden > _CUTE_MAX_HIDDEN:
        return f"hidden {hidden} > {_CUTE_MAX_HIDDEN}: a row must fit one CTA's registers"
    return vector_rows_supported(workload)


@register("boundary", "cute", "cute", supports=_boundary_cute_supports, configs=_BOUNDARY_CUTE_CONFIGS,
          configure=lambda cfg: functools.partial(_boundary_cute_at, **cfg))
def boundary_cute(y, h, w, *, eps, group=None):
    """One CuTe DSL kernel per row: RMSNorm(y) -> a*h + b*(.) -> round -> RMSNorm(h_new) -> round."""
    return _boundary_cute_at(y, h, w, eps=eps, group=group, **_BOUNDARY_CUTE_CONFIGS[0])
