"""`experts:triton`: the fused MoE of `kernels/moe.py`, two Triton kernels per path: GEMV (few routed
pairs: reads only the selected experts) or grouped (tensor-core GEMMs over pairs sorted by expert).

A config's "path" forces GEMV or grouped, so the search picks the path at the target's batch
(docs/decisions.md #27); no config picks by size. A GEMV config still groups past
`GEMV_HARD_MAX_PAIRS` pairs, where it would re-read each expert per pair. The kernels are imported on
the first call: this module must import without triton, and under the CPU interpreter
TRITON_INTERPRET must be set before they are defined.
"""

from workbench.registry import register

CONFIGS = [
    # GEMV: BLOCK_N ff rows x BLOCK_K hidden per gate/up step (hidden in SPLIT_K slices, default 1);
    # DOWN_* = hidden rows x ff per down step; DOWN_WARPS (default num_warps) for the down kernel
    dict(path="gemv", BLOCK_N=8, BLOCK_K=512, DOWN_BLOCK_N=16, DOWN_BLOCK_K=64, num_warps=4, num_stages=1),
    dict(path="gemv", BLOCK_N=4, BLOCK_K=1024, DOWN_BLOCK_N=8, DOWN_BLOCK_K=128, num_warps=4, num_stages=1),
    # 2 warps with a 4 x 64 down tile (the decode lock's choice), then the same with gate/up tiles that
    # do not spill registers at 2 warps on sm_90 (the 1024- and 2048-wide ones do: docs/decisions.md #26)
    dict(path="gemv", BLOCK_N=8, BLOCK_K=512, DOWN_BLOCK_N=4, DOWN_BLOCK_K=64, num_warps=2, num_stages=1),
    dict(path="gemv", BLOCK_N=8, BLOCK_K=256, DOWN_BLOCK_N=4, DOWN_BLOCK_K=64, num_warps=2, num_stages=1),
    dict(path="gemv", BLOCK_N=4, BLOCK_K=512, DOWN_BLOCK_N=4, DOWN_BLOCK_K=64, num_warps=2, num_stages=1),
    dict(path="gemv", BLOCK_N=2, BLOCK_K=1024, DOWN_BLOCK_N=4, DOWN_BLOCK_K=64, num_warps=2, num_stages=1),
    # 8 x 256 at 2 warps with the default 16 x 64 down tile at 8 warps
    dict(path="gemv", BLOCK_N=8, BLOCK_K=256, DOWN_BLOCK_N=16, DOWN_BLOCK_K=64, num_warps=2, num_stages=1,
         DOWN_WARPS=8),
    # 8 x 256 above with hidden cut in 2 / 4 slices: 2-4x the gate/up programs streaming at once
    dict(path="gemv", BLOCK_N=8, BLOCK_K=256, DOWN_BLOCK_N=4, DOWN_BLOCK_K=64, num_warps=2, num_stages=1, SPLIT_K=2),
    dict(path="gemv", BLOCK_N=8, BLOCK_K=256, DOWN_BLOCK_N=4, DOWN_BLOCK_K=64, num_warps=2, num_stages=1, SPLIT_K=4),
    # grouped: BLOCK_M routed rows x BLOCK_N outputs x BLOCK_K reduction, for both GEMMs unless DOWN_*
    # (BLOCK_N, BLOCK_K, WARPS, STAGES) give the down GEMM its own
    dict(path="grouped", BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(path="grouped", BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(path="grouped", BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(path="grouped", BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(path="grouped", BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3),
    # The 8 x 2K prefill lock's tile with wider down tiles: gate/up's N is ff (320 at TP8: 64 divides
    # it), down's is hidden (5120), and down holds one accumulator where gate/up holds two. None spills
    # on sm_90, and each pipelines its loads (`scripts/sm90_resources.py`)
    dict(path="grouped", BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3, DOWN_BLOCK_N=128),
    dict(path="grouped", BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3, DOWN_BLOCK_N=256,
         DOWN_BLOCK_K=32),
    dict(path="grouped", BLOCK_M=128, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=4, DOWN_BLOCK_N=128,
         DOWN_WARPS=8, DOWN_STAGES=3),
]


def _supports(wl):
    if wl.dtype not in ("bf16", "fp16", "fp32"):
        return f"experts:triton takes bf16, fp16 or fp32 weights, not {wl.dtype}"
    return True  # any hidden / ff / experts / top_k: every tile is masked or wrapped


def _config_supports(config, wl):
    from workbench.variants.kernels.moe import GEMV_HARD_MAX_PAIRS  # kernels: imported on use

    pairs = wl.tokens * wl.config.num_experts_per_tok
    if config["path"] == "gemv" and pairs > GEMV_HARD_MAX_PAIRS:
        return f"{pairs} routed pairs run a GEMV config as the grouped default (GEMV stops at {GEMV_HARD_MAX_PAIRS})"
    return True


def _at(config=None):
    def experts_triton(x, ids, weights, w):
        from workbench.variants.kernels.moe import fused_experts

        return fused_experts(x, ids, weights, w, config)
    return experts_triton


register("experts", "triton", "triton", supports=_supports, configs=CONFIGS, configure=_at,
         config_supports=_config_supports, pdl=True)(_at())
