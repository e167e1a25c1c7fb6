"""`route:triton_cublas`: at prefill sizes, the FP32 router GEMM as cuBLAS BF16 GEMMs on route:triton's exact
split of the weight, then route:triton's selection kernel (both in `kernels/route_select.py`).

The split (`prepare_router`) is W = w1 + w2 + w3, each BF16; with BF16 activations every product
x_k * w_jk is exact in FP32, so three BF16 GEMMs with FP32 accumulation and FP32 output
(`torch.mm(..., out_dtype=torch.float32)`) sum the same products as an FP32 GEMM, in another order.
At prefill sizes the router GEMM is compute-bound on these pieces, where cuBLAS's Hopper kernels run
nearer the tensor cores' rate than route:triton's tile kernel for the same split (`_route_mm`).

Configs:
- gemms: how the three products are made. "chain": the second and third GEMM add the running FP32
  sum in their epilogue (`addmm`, beta 1): one [N, E] FP32 result, the smallest pieces first; the
  selection reads it once. "split": three GEMMs into [3, N, E] partials (w3, w2, w1), summed in that
  order by the selection (its split-K input), which reads three times the bytes. "batched": the same
  partials from one batched GEMM (`bmm`, x broadcast over the pieces) in the pieces' own order (w1, w2,
  w3): one launch instead of three, and the ~1-wave tail of each N-256 GEMM (128 tiles of 128 x 256 on
  132 SMs) becomes one 3-wave grid. The order only moves FP32 rounding, as any GEMM's K order does.
- select_tokens, select_warps: tokens per program of the selection and its warps. At prefill the
  selection is latency-bound in its 2 * top_k + 2 * topk_group + 5 reductions, not by the bytes of
  the partials it reads, so fewer tokens per program (down to one warp per token, all shuffles) are
  tried beside route:triton's 4 tokens x 4 warps.

At most ROUTE_FP32_MAX tokens (decode, small batches) the GEMMs would be weight-bound on 7.8 MB of BF16
pieces instead of 5.2 MB of FP32: there it runs route:triton at its default config, the same kernels; so
it does for activations other than BF16 (which `supports` declines: the search never times it there).
"""

import torch

from workbench.registry import register
from workbench.variants.kernels.route_select import prepare_router, route_select, select_args
from workbench.variants.kernels.triton_common import pow2, triton
from workbench.variants.route.triton import CONFIGS as TRITON_CONFIGS
from workbench.variants.route.triton import ROUTE_FP32_MAX, route_triton_at

# No select_tokens 2: at 2 tokens a program the selection gives NaN weights on the H200 under Triton 3.6
# (passing interpreted), as route:triton's configs note; the op gate rejects it there.
CONFIGS = [dict(gemms="chain", select_tokens=4, select_warps=4),
           *[dict(gemms=g, select_tokens=t, select_warps=w) for g in ("split", "batched")
             for t, w in ((4, 4), (1, 1), (1, 2), (4, 2), (8, 4))]]

_small = route_triton_at(TRITON_CONFIGS[0])


def _mm_f32(x, w, *, acc=None, out=None):
    """x [N, K] @ w [E, K]^T (+ acc, FP32): BF16 inputs, FP32 accumulation and output (into `out`)."""
    if x.is_cuda:
        if acc is None:
            return torch.mm(x, w.t(), out_dtype=torch.float32, out=out)
        return torch.addmm(acc, x, w.t(), out_dtype=torch.float32, out=out)
    res = x.float() @ w.float().t()  # CPU (no out_dtype kernels there): the same exact products in FP32
    res = res if acc is None else acc + res
    return res if out is None else out.copy_(res)


def _bmm_f32(x, pieces):
    """[3, N, E] partials x @ piece^T, one batched GEMM over x broadcast (a view of batch stride 0;
    whether cuBLAS reads it without a copy is not profiled)."""
    if x.is_cuda:
        return torch.bmm(x.expand(pieces.shape[0], -1, -1), pieces.transpose(1, 2), out_dtype=torch.float32)
    return x.float()[None] @ pieces.float().transpose(1, 2)


def _at(config=None):
    config = config or CONFIGS[0]
    gemms, select_tokens, select_warps = config["gemms"], config["select_tokens"], config["select_warps"]

    def route_triton_cublas(x, w, *, n_group, topk_group, top_k, scale):
        n = x.shape[0]
        if n <= ROUTE_FP32_MAX or x.dtype != torch.bfloat16:  # other activations: route:triton splits them too
            return _small(x, w, n_group=n_group, topk_group=topk_group, top_k=top_k, scale=scale)
        x = x.contiguous()
        w1, w2, w3 = w["bf16x3"]
        if gemms == "chain":
            part = _mm_f32(x, w1, acc=_mm_f32(x, w2, acc=_mm_f32(x, w3)))[None]
        elif gemms == "batched":
            part = _bmm_f32(x, w["bf16x3"])
        else:
            part = torch.empty((3, n, w1.shape[0]), dtype=torch.float32, device=x.device)
            for s, piece in enumerate((w3, w2, w1)):
                _mm_f32(x, piece, out=part[s])
        ids = torch.empty((n, top_k), dtype=torch.int64, device=x.device)
        weights = torch.empty((n, top_k), dtype=torch.float32, device=x.device)
        block_t = min(select_tokens, pow2(n))
        outs, sizes, consts = select_args(part, w, ids, weights, n_group, topk_group, top_k, scale, block_t)
        route_select[(triton.cdiv(n, block_t),)](part, *outs, n, *sizes, **consts, num_warps=select_warps)
        return ids, weights

    return route_triton_cublas


def _supports(wl):
    if wl.dtype != "bf16":
        return (f"route:triton_cublas splits only the weight: its products are exact for BF16 activations, "
                f"not {wl.dtype}")
    if not (hasattr(torch.ops.aten.addmm, "dtype") and hasattr(torch.ops.aten.bmm, "dtype")):
        return f"route:triton_cublas needs matmuls with out_dtype (torch >= 2.8), not torch {torch.__version__}"
    return True


def _config_supports(config, wl):
    if wl.tokens <= ROUTE_FP32_MAX and config != CONFIGS[0]:
        return f"at most {ROUTE_FP32_MAX} tokens every config runs route:triton's default: timed once"
    return True


register("route", "triton_cublas", "triton", prepare=prepare_router, supports=_supports, configs=CONFIGS,
         config_supports=_config_supports, configure=_at)(_at())
