"""`attn_out:triton_fp8`: the Triton output gate (`kernels/output_gate.py`: o * sigmoid(g + bias) in FP32,
rounded once), then o_proj on FP8 weights through the weight-only FP8 GEMV (`kernels/gemv_fp8.py`). Reads
only FP8 weights (docs/decisions.md #42), and only decode sizes are offered to it (up to `gemv_fp8.MAX_ROWS`
rows); past them it still computes the contract.

The GEMV is imported on the first call: this module must import without triton, and under the CPU
interpreter TRITON_INTERPRET must be set before the kernel is defined.
"""

import functools

from workbench.registry import register
from workbench.variants.kernels.fp8_decode import CONFIGS, decode_supports
from workbench.variants.kernels.output_gate import output_gate


def attn_out_triton_fp8(o, g, w, cfg=CONFIGS[0]):
    from workbench.variants.kernels.gemv_fp8 import fp8_linear  # kernels: imported on use

    return fp8_linear(output_gate(o, g, w["gate_bias"], pdl=cfg.get("pdl", False)), w["o_proj"], cfg)


register("attn_out", "triton_fp8", "triton", supports=decode_supports("attn_out:triton_fp8"), configs=CONFIGS,
         configure=lambda cfg: functools.partial(attn_out_triton_fp8, cfg=cfg),
         pdl=True, formats=("fp8",))(attn_out_triton_fp8)
