"""`boundary:triton`: the whole boundary (after the all-reduce) in one Triton kernel, one program per row:
RMSNorm(y) -> a*h + b*(.) -> round -> RMSNorm(h_new) -> round, y and h read once, h_new and x_next
written once.

Kernels are defined only when triton imports; the variant is registered either way and the registry
reports the backend as unavailable.
"""

import functools

import torch

from workbench.registry import register
from workbench.variants.kernels.tensor_parallel import all_reduced
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


MAX_HIDDEN = 8192  # one row must fit one block of registers
CONFIGS = [{"num_warps": 8}, {"num_warps": 16}, {"num_warps": 4}, {"num_warps": 32}]


def _boundary_triton_at(y, h, w, *, eps, group=None, num_warps=8, pdl=False):
    y = all_reduced(y, group)
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


def _supports(workload):
    hidden = workload.config.hidden_size
    if workload.dtype not in ("bf16", "fp16", "fp32"):
        return f"dtype {workload.dtype} not handled (bf16, fp16, fp32)"
    if hidden > MAX_HIDDEN:
        return f"hidden {hidden} > {MAX_HIDDEN}: a row must fit one block"
    return True


@register("boundary", "triton", "triton", supports=_supports, configs=CONFIGS, pdl=True,
          configure=lambda cfg: functools.partial(_boundary_triton_at, **cfg))
def boundary_triton(y, h, w, *, eps, group=None):
    """One Triton kernel per row: RMSNorm(y) -> a*h + b*(.) -> round -> RMSNorm(h_new) -> round."""
    return _boundary_triton_at(y, h, w, eps=eps, group=group, **CONFIGS[0])
