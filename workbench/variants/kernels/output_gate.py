"""attn_out's output gate in Triton, shared by the `attn_out` variants and `attention_out`'s prefill
path: out_h = o_h * sigmoid(g_h + b_h) in FP32, rounded once to the model dtype (the contract in
`workbench/variants/attn_out/__init__.py`).

- `output_gate`: the gate as one elementwise kernel (one read of o and g, one write).
- `gated_linear`: that kernel, then o_proj by F.linear (cuBLAS): attn_out:triton, and what the GEMV
  variants run past GATED_GEMV_MAX_TOKENS rows.
- `gated_tile`: the gate inside another kernel (a GEMV's A tile), the same arithmetic.
- `supports`: the dtypes these kernels take.

Imports without triton: the kernels are defined only where it imports, and the variants register
either way (the registry reports the backend as unavailable).
"""

import torch
import torch.nn.functional as F

from workbench.variants.kernels.triton_common import pdl_launch, triton

if triton is not None:
    import triton.language as tl

    from workbench.variants.kernels.triton_common import pdl_enter, round_to

    @triton.jit
    def _gate(o, g, bias):
        """o * sigmoid(g + bias) in FP32, sigmoid as 1 / (1 + exp(-x)) and rounded apart, like torch."""
        return o.to(tl.float32) * (1.0 / (1.0 + tl.exp(-(g.to(tl.float32) + bias.to(tl.float32)))))

    @triton.jit
    def _gate_kernel(o_ptr, g_ptr, bias_ptr, out_ptr, o_stride_n, o_stride_h, g_stride, width,
                     HD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """The output gate of BLOCK channels of one token, rounded once to the model dtype: the whole
        elementwise chain (add, sigmoid, mul, round) in one read of o and g and one write."""
        pdl_enter(PDL)
        n = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = c < width
        o = tl.load(o_ptr + n * o_stride_n + (c // HD) * o_stride_h + c % HD, mask=mask)
        g = tl.load(g_ptr + n * g_stride + c, mask=mask)
        b = tl.load(bias_ptr + c // HD, mask=mask)
        tl.store(out_ptr + n * width + c, round_to(_gate(o, g, b), out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def gated_tile(o_ptr, g_ptr, bias_ptr, m, k, n_tokens, width, o_stride_n, o_stride_h, g_stride,
                   HD: tl.constexpr, DTYPE: tl.constexpr):
        """The gated activations of tokens m, channels k, rounded to DTYPE (a GEMV step's A tile)."""
        a_mask = (m < n_tokens) & (k[None, :] < width)
        o = tl.load(o_ptr + m * o_stride_n + (k[None, :] // HD) * o_stride_h + k[None, :] % HD, mask=a_mask)
        g = tl.load(g_ptr + m * g_stride + k[None, :], mask=a_mask)
        b = tl.load(bias_ptr + k[None, :] // HD, mask=k[None, :] < width)
        return round_to(_gate(o, g, b), DTYPE)


# attn_out:triton's configs (BLOCK channels a program); the first is every other caller's
GATE_CONFIGS = [{"BLOCK": 1024, "num_warps": 4}, {"BLOCK": 256, "num_warps": 2},
                {"BLOCK": 512, "num_warps": 4}, {"BLOCK": 2048, "num_warps": 8}]
GATED_GEMV_MAX_TOKENS = 16  # one 16-row dot tile; above it the GEMM is cuBLAS's job


def output_gate(o, g, bias, *, BLOCK=1024, num_warps=4, pdl=False):
    """gated [N, heads*hd] in the model dtype (the Triton gate kernel alone). `pdl`: see `pdl_launch`."""
    n, heads, hd = o.shape
    width = heads * hd
    o = o if o.stride(-1) == 1 else o.contiguous()
    g = g if g.stride(-1) == 1 else g.contiguous()
    out = torch.empty((n, width), dtype=o.dtype, device=o.device)
    if n:
        _gate_kernel[(n, triton.cdiv(width, BLOCK))](o, g, bias, out, o.stride(0), o.stride(1), g.stride(0),
                                                     width, HD=hd, BLOCK=BLOCK, num_warps=num_warps,
                                                     **pdl_launch(pdl))
    return out


def gated_linear(o, g, w, **cfg):
    """The `attn_out` contract as the gate kernel at `cfg` (one of GATE_CONFIGS, "pdl"), then F.linear."""
    return F.linear(output_gate(o, g, w["gate_bias"], **cfg), w["o_proj"])


def supports(workload):
    if workload.dtype not in ("bf16", "fp16", "fp32"):
        return f"dtype {workload.dtype} not handled (bf16, fp16, fp32)"
    return True
