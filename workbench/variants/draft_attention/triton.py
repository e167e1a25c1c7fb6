"""`draft_attention:triton`: the block's keys read in place through their pages, one kernel with an FP32 online
softmax over them, its splits merged by a second (`kernels/draft_attention.py`).

Configs: BLOCK_M (row, query head) pairs of a kv head a program, BLOCK_N keys a step, the keys split
SPLITS ways (1: no merge launch). A drafter's block at beam-mini is 16 rows x 2 query heads a kv head
over a window of keys: one program a kv head is latency-bound, so the splits and row tiles trade its
loop for more programs.
"""

from workbench.registry import register

CONFIGS = [
    dict(BLOCK_M=64, BLOCK_N=64, SPLITS=1, num_warps=4, num_stages=2),  # kernels/draft_attention.DEFAULT
    dict(BLOCK_M=64, BLOCK_N=64, SPLITS=4, num_warps=4, num_stages=2),
    dict(BLOCK_M=32, BLOCK_N=64, SPLITS=2, num_warps=4, num_stages=2),
    dict(BLOCK_M=32, BLOCK_N=32, SPLITS=4, num_warps=2, num_stages=2),
    dict(BLOCK_M=16, BLOCK_N=64, SPLITS=8, num_warps=4, num_stages=2),
    dict(BLOCK_M=64, BLOCK_N=32, SPLITS=16, num_warps=4, num_stages=2),
    dict(BLOCK_M=128, BLOCK_N=64, SPLITS=8, num_warps=8, num_stages=2),
]


def supports(wl):
    c = wl.config
    if wl.dtype not in ("bf16", "fp16", "fp32"):
        return f"draft_attention:triton takes bf16, fp16 or fp32 queries and store, not {wl.dtype}"
    if c.head_dim > 256:
        return f"draft_attention:triton handles head_dim <= 256 (an FP32 accumulator row a query), got {c.head_dim}"
    return True


def _at(config=None):
    def draft_attention_triton(q, store, pages, offsets, mask):
        from workbench.variants.kernels.draft_attention import block_attention

        return block_attention(q, store, pages, offsets, mask, config=config)
    return draft_attention_triton


register("draft_attention", "triton", "triton", supports=supports, configs=CONFIGS, pdl=True,
         configure=_at)(_at())
