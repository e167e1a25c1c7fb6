"""`qkvg_proj:triton`: the packed q/k/v/gate weight (`kernels/packed_qkvg.py`) through the Triton GEMV
(`kernels/gemv.py`), which writes q, k, v and g segment-major into one buffer, so all four outputs are
contiguous without a copy.

Registered whether or not triton imports; the registry reports a missing backend.
"""

import functools

from workbench.registry import register
from workbench.variants.kernels.packed_qkvg import pack_qkvg
from workbench.variants.kernels.triton_common import gemv_config as _cfg

try:  # the variant is registered either way; the registry reports a missing triton
    from workbench.variants.kernels import gemv
except ImportError:
    gemv = None

# Tuned for TP8 (5120 -> 1792 rows): FMA GEMVs for M = 1-4 (224-560 CTAs, so 132 SMs keep enough
# weight loads in flight), tl.dot with M padded to 16 for M = 8-16, tiled tl.dot for M = 64 and prefill.
CONFIGS = [
    _cfg(8, 512), _cfg(8, 1024, warps=8), _cfg(4, 1024), _cfg(16, 512, split_k=2, warps=8),
    _cfg(16, 256, split_k=4), _cfg(16, 1024, split_k=5, warps=8),
    _cfg(16, 256, split_k=2, stages=4, dot=True), _cfg(32, 128, split_k=4, stages=4, dot=True),
    _cfg(32, 128, split_k=4, stages=3, bm=64, dot=True), _cfg(64, 64, split_k=8, stages=4, bm=64, dot=True),
    _cfg(128, 64, warps=8, stages=3, bm=128, dot=True),
]


def _supports(wl):
    if wl.dtype not in ("bf16", "fp16", "fp32"):
        return f"the Triton GEMV takes bf16/fp16/fp32 weights, not {wl.dtype}"
    return True  # any M: configs with BLOCK_M 64/128 are the tiled path; the harness times them all


def _prepare(w):
    return {**pack_qkvg(w), "locks": gemv.new_locks(w["q_proj"].device)}


@register("qkvg_proj", "triton", "triton", prepare=_prepare, supports=_supports,
          configs=CONFIGS, pdl=True, configure=lambda cfg: functools.partial(qkvg_triton, cfg=cfg))
def qkvg_triton(x, w, cfg=CONFIGS[0]):
    """The packed weight through the Triton GEMV; the kernel writes q, k, v, g segment-major into one
    buffer, so all four outputs are contiguous without a copy."""
    return gemv.linear(x, w["qkvg"], cfg, w["locks"], splits=w["sizes"])
