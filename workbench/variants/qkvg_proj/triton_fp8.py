"""`qkvg_proj:triton_fp8`: the four projections on FP8 weights through the weight-only FP8 GEMV
(`kernels/gemv_fp8.py`), one launch a projection: each reads its E4M3 bytes as stored and applies its row
scales once after the reduction. Reads only FP8 weights (docs/decisions.md #42), and only decode sizes are
offered to it (up to `gemv_fp8.MAX_ROWS` rows); past them it still computes the contract.

The kernel is imported on the first call: this module must import without triton, and under the CPU
interpreter TRITON_INTERPRET must be set before the kernel is defined.
"""

import functools

from workbench.registry import register

# BLOCK_N weight rows x BLOCK_K inputs a step at one row (the K tile shrinks as the rows grow); the first is
# the default.
CONFIGS = [
    dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=1),
    dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=1),
    dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=2),
]


def _supports(wl):
    from workbench.variants.kernels.gemv_fp8 import MAX_ROWS  # kernels: imported on use

    if wl.dtype not in ("bf16", "fp16", "fp32"):
        return f"qkvg_proj:triton_fp8 computes in bf16, fp16 or fp32, not {wl.dtype}"
    if wl.tokens > MAX_ROWS:
        return f"a decode GEMV: past {MAX_ROWS} rows each row tile re-reads the weights"
    return True


def qkvg_triton_fp8(x, w, cfg=CONFIGS[0]):
    from workbench.variants.kernels.gemv_fp8 import fp8_linear  # kernels: imported on use

    return tuple(fp8_linear(x, w[k], cfg) for k in ("q_proj", "k_proj", "v_proj", "gate_proj"))


register("qkvg_proj", "triton_fp8", "triton", supports=_supports, configs=CONFIGS, pdl=True, formats=("fp8",),
         configure=lambda cfg: functools.partial(qkvg_triton_fp8, cfg=cfg))(qkvg_triton_fp8)
