"""`attention_out:triton_merged`: attention:triton's split-K decode, then o_proj as a GEMV that merges
the splits and applies the gate in its prologue (`kernels/attention_merged_gemv.py`): two launches a
layer where attention_out:triton takes three. Each GEMV program re-reads its heads' partials, so the
merge is only worth it while they are few: a decode with more than `max_splits` splits (a long
full-attention context) or more than `max_tokens` tokens, and every prefill, run attention_out:triton's
sequence (`kernels/attention_three_launches.py`) at the config's `attention` and `gemv`.

A config: `attention` (one of `attention_configs.TRITON_CONFIGS`), `merged` (the merged GEMV's BLOCK_N
rows a program, HEADS query heads a program, num_warps), `gemv` (attention_out:triton's o_proj tile, for
the calls it takes), `max_splits`, `max_tokens`; "pdl" applies to every launch.
"""

from workbench.registry import register
from workbench.variants.kernels.attention_configs import TRITON_CONFIGS as ATTENTION_CONFIGS
from workbench.variants.kernels.attention_three_launches import launch_configs, supports, three_launches
from workbench.variants.kernels.triton_common import gemv_config


def _config(attention, block_n, heads, warps=4, max_splits=32, max_tokens=1):
    return dict(attention=attention, merged=dict(BLOCK_N=block_n, HEADS=heads, num_warps=warps),
                gemv=gemv_config(4, 256), max_splits=max_splits, max_tokens=max_tokens)


# The decode lock's attention config (17 splits of 32 keys over a 512-key window), then 9 splits of
# 64 (attention's default: half the partials to re-read); a program per 32 or 64 rows of o_proj with
# all six heads of the TP8 rank, or three, or one (more programs, each re-reading fewer partials).
# Several heads a program take 8 warps: at 4, 64 rows spill and 32 use all 255 registers (none of
# these spills, compiled for sm_90: tests/variants/test_triton_sm90_compile.py).
CONFIGS = [
    _config(ATTENTION_CONFIGS[5], 32, 6, warps=8),
    _config(ATTENTION_CONFIGS[5], 64, 6, warps=8),
    _config(ATTENTION_CONFIGS[5], 32, 3, warps=8),
    _config(ATTENTION_CONFIGS[5], 64, 1),
    _config(ATTENTION_CONFIGS[0], 32, 6, warps=8),
    _config(ATTENTION_CONFIGS[0], 64, 3, warps=8),
]


def _at(config=None):
    config = config or CONFIGS[0]
    pdl, three_attention, three_gemv = launch_configs(config)

    def attention_out_triton_merged(q, cache, meta, g, w, *, window, scale):
        # kernels: imported on use (they need triton, and TRITON_INTERPRET set first on the CPU)
        from workbench.variants.kernels import attention_merged_gemv as merged

        # static shape dispatch (graph-safe): the split count comes from shapes and the SM count
        if meta.decode and 0 < q.shape[0] <= config["max_tokens"]:
            splits = merged.merged_splits(q, cache, meta, window, config["attention"])
            if splits <= config["max_splits"]:
                return merged.decode_merged(q, cache, meta, g, w["gate_bias"], w["o_proj"], window=window,
                                            scale=scale, attention_cfg=config["attention"],
                                            merged_cfg=config["merged"], pdl=pdl, splits=splits)
        return three_launches(q, cache, meta, g, w, window=window, scale=scale, attention_cfg=three_attention,
                              gemv_cfg=three_gemv, pdl=pdl)
    return attention_out_triton_merged


register("attention_out", "triton_merged", "triton", supports=supports, configs=CONFIGS, configure=_at,
         pdl=True)(_at())
