"""`attention:flashinfer`: FlashInfer's paged decode (FA2, CUDA-core or tensor-core) and prefill wrappers
on the cache as it is (`kernels/flashinfer_attention.py`). Decode plans are made outside CUDA graphs: a
runner that refills a captured step's metadata calls the bound callable's `replan(meta)` before
replaying (see `beam_model.model.replan`).

FlashInfer is imported on the first call: this module must import without it (docs/decisions.md #25).
"""

import sys

from workbench.registry import register

HEAD_DIMS = (64, 128, 256)  # the head sizes FlashInfer's kernels are instantiated for


def _supports(wl):
    if wl.dtype not in ("bf16", "fp16"):
        return f"attention:flashinfer takes bf16 or fp16 q and KV cache, not {wl.dtype}"
    if wl.config.head_dim not in HEAD_DIMS:
        return f"attention:flashinfer needs head_dim in {HEAD_DIMS}, got {wl.config.head_dim}"
    return True


def _replan(meta):
    module = sys.modules.get("workbench.variants.kernels.flashinfer_attention")
    if module is not None:  # never called yet: nothing planned
        module.replan(meta)


def _at(config=None):
    tensor_cores = bool((config or {}).get("tensor_cores", False))

    def attention_flashinfer(q, cache, meta, *, window, scale):
        from workbench.variants.kernels.flashinfer_attention import paged_attention

        return paged_attention(q, cache, meta, window=window, scale=scale, tensor_cores=tensor_cores)
    attention_flashinfer.replan = _replan
    return attention_flashinfer


register("attention", "flashinfer", "flashinfer", supports=_supports,
         configs=[dict(tensor_cores=False), dict(tensor_cores=True)], configure=_at)(_at())
