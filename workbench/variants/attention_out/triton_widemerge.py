"""`attention_out:triton_widemerge`: attention_out:triton_prefetch with attention:triton_widemerge's
merge: the prefetch decode kernel, then a merge-gate that loads each head's split partials in one
round trip over MERGE_BLOCK_D-column programs (`kernels/attention_widemerge.py`), then the o_proj GEMV.
Prefill (and decode past the gated GEMV's rows) is attention_out:triton's
(`kernels/attention_three_launches.py`).

Configs: the decode lock's attention config with its o_proj tile, merged 16 and 8 columns a program (at
batch 1, 4K context, the 16-column merge is the faster at full attention and ties at window 512), then
attention:triton_widemerge's 64-key blocks at 8 warps (up to 512 splits), the fastest attention at
decode-b1 (docs/variants.md), merged 16 columns a program.
"""

from workbench.registry import register
from workbench.variants.kernels.attention_configs import PREFETCH_CONFIGS, WIDEMERGE_CONFIGS
from workbench.variants.kernels.attention_three_launches import launch_configs, supports, three_launches
from workbench.variants.kernels.output_gate import GATED_GEMV_MAX_TOKENS
from workbench.variants.kernels.triton_common import gemv_config

CONFIGS = [dict(attention=dict(PREFETCH_CONFIGS[4], MERGE_BLOCK_D=block_d), gemv=gemv_config(4, 256))
           for block_d in (16, 8)]
CONFIGS += [dict(attention=dict(WIDEMERGE_CONFIGS[2], MERGE_BLOCK_D=16), gemv=gemv_config(4, 256))]


def _at(config=None):
    pdl, attention_cfg, gemv_cfg = launch_configs(config or CONFIGS[0])

    def attention_out_triton_widemerge(q, cache, meta, g, w, *, window, scale):
        # kernels: imported on use (they need triton, and TRITON_INTERPRET set first on the CPU)
        from workbench.variants.kernels.attention_widemerge import decode_gated
        from workbench.variants.kernels.gemv import linear

        if meta.decode and 0 < q.shape[0] <= GATED_GEMV_MAX_TOKENS:  # static shape dispatch: graph-safe
            gated = decode_gated(q, cache, meta, g, w["gate_bias"], window=window, scale=scale, cfg=attention_cfg)
            return linear(gated, w["o_proj"].contiguous(), gemv_cfg)
        return three_launches(q, cache, meta, g, w, window=window, scale=scale, attention_cfg=attention_cfg,
                              gemv_cfg=gemv_cfg, pdl=pdl)
    return attention_out_triton_widemerge


register("attention_out", "triton_widemerge", "triton", supports=supports, configs=CONFIGS, configure=_at,
         pdl=True)(_at())
