"""`attention_out:triton_tasks`: a decode step's attention, merge-gate and o_proj in one persistent
launch (`kernels/attention_tasks.py`, on `kernels/task_queue.py`): attention and merge-gate tasks come
from a ticket queue and hand their partials and gated activations on through per-tile counters; each
program's o_proj rows are fixed, and their weight tile is loaded when the program starts, before the
PDL wait, so o_proj's weights stream while the previous kernel and the attention run. The first brick
of a persistent decode layer (docs/decisions.md #47). Prefill, and decode past `max_tokens` rows, run
attention_out:triton's sequence (`kernels/attention_three_launches.py`) at the config's `attention` and
`gemv`.

A config: `attention` (one of `attention_configs.TRITON_CONFIGS`: splits, key block, EARLY_V), `tasks`
(ROWS of o_proj a task, PER_SM programs a SM, num_warps of the launch), `gemv` (the fallback's o_proj
tile) and `max_tokens`; "pdl" applies to every launch.
"""

from workbench.registry import register
from workbench.variants.kernels.attention_configs import TRITON_CONFIGS as ATTENTION_CONFIGS
from workbench.variants.kernels.attention_three_launches import launch_configs, supports, three_launches
from workbench.variants.kernels.triton_common import gemv_config


def _config(attention, rows, warps, per_sm=1, max_tokens=1):
    return dict(attention=attention, tasks=dict(ROWS=rows, PER_SM=per_sm, num_warps=warps), gemv=gemv_config(4, 256),
                max_tokens=max_tokens)


# The decode lock's attention config (17 splits of 32 keys over a 512-key window) and attention's
# default (9 splits of 64); 16 or 32 o_proj rows a task (a [rows, 1024] BF16 weight tile held from the
# kernel's start at the TP8 rank's 768 columns: 64 registers a thread at 4 warps for 16 rows, at 8 for
# 32); programs a SM so that each o_proj task of the rank's 5120 rows has its own program (2 a SM for
# 32 rows, 3 for 16) or so that all are resident at once (1 for 32 rows, 2 for 16; the rest then take
# a second task); and four decode rows a launch.
CONFIGS = [
    _config(ATTENTION_CONFIGS[5], 16, 4, per_sm=2),
    _config(ATTENTION_CONFIGS[5], 32, 8, per_sm=1),
    _config(ATTENTION_CONFIGS[5], 32, 8, per_sm=2),
    _config(ATTENTION_CONFIGS[5], 16, 4, per_sm=3),
    _config(ATTENTION_CONFIGS[0], 16, 4, per_sm=2),
    _config(ATTENTION_CONFIGS[5], 16, 4, per_sm=2, max_tokens=4),
]


def _at(config=None):
    config = config or CONFIGS[0]
    pdl, attention_cfg, gemv_cfg = launch_configs(config)

    def attention_out_triton_tasks(q, cache, meta, g, w, *, window, scale):
        # kernels: imported on use (they need triton, and TRITON_INTERPRET set first on the CPU)
        from workbench.variants.kernels.attention_tasks import decode_tasks

        if meta.decode and 0 < q.shape[0] <= config["max_tokens"]:  # static shape dispatch: graph-safe
            return decode_tasks(q, cache, meta, g, w["gate_bias"], w["o_proj"], window=window, scale=scale,
                                attention_cfg=attention_cfg, tasks_cfg=config["tasks"], pdl=pdl)
        return three_launches(q, cache, meta, g, w, window=window, scale=scale, attention_cfg=attention_cfg,
                              gemv_cfg=gemv_cfg, pdl=pdl)
    return attention_out_triton_tasks


register("attention_out", "triton_tasks", "triton", supports=supports, configs=CONFIGS, configure=_at,
         pdl=True)(_at())
