"""Triton kernel of `attention_out:triton_tasks`: a decode step's attention and o_proj as one persistent
launch (three launches in attention_out:triton: split-K decode, merge-gate, GEMV).

Queued tasks, in ticket order (`kernels/task_queue.py`; each after what it reads):
1. attention: one (sequence, kv head, split) of attention:triton's split-K decode: its GQA group's
   queries against its share of the visible keys, partials (max, sum, accumulator) stored; counted into
   the (sequence, kv head)'s counter.
2. merge-gate: one (token, query head, MERGE_BLOCK_D columns): waits for its kv head's splits, merges
   them (attention's `merge_head`), rounds as `attention` does, gates as `attn_out` does, rounds again
   (`attention_gated_merge.gate_store`): the same bits as attention_out:triton's merge-gate kernel;
   counted into the token's counter.
Then each program's own o_proj tasks (ROWS rows of o_proj for one token: tasks p, p + programs, ...),
once the queue is empty: every queued task is then held by a running program, so waiting on them cannot
deadlock. A program loads its first task's weight tile when it starts, before the PDL wait (weights are
never written), and the next one's after each task; it waits for the token's gated activations, then
takes one FP32 dot per row, rounded once.

Imported on the variant's first call (kernels need triton, and TRITON_INTERPRET set first under the
CPU interpreter).
"""

import torch
import triton
import triton.language as tl

from workbench.variants.kernels import attention as attn
from workbench.variants.kernels import task_queue as queue
from workbench.variants.kernels.attention_gated_merge import gate_store
from workbench.variants.kernels.triton_common import INTERPRETED, pdl_enter, pdl_launch, round_to

COUNTER_BLOCK = 64  # counters the last program zeroes per step


@triton.jit
def _attention_task(t, q_ptr, cache_ptr, table_ptr, seq_lens_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, done_ptr,
                    stride_qn, stride_qh, stride_cp, stride_ckv, stride_ct, stride_ch, stride_tb,
                    max_pages, window, qk_scale, n_heads, kv_heads, head_dim, n_splits,
                    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr,
                    EARLY_V: tl.constexpr):
    """Task t of the attention stage: attention:triton's decode program (sequence, kv head, split),
    the same blocks in the same order, its partials stored."""
    b = t // (kv_heads * n_splits)
    kvh = (t // n_splits) % kv_heads
    split = t % n_splits
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    hi = tl.minimum(pos + 1, seq_len)
    if HAS_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    else:
        lo = pos * 0
    first = lo // BLOCK_N
    last = tl.maximum(tl.cdiv(hi, BLOCK_N), first)
    per = tl.cdiv(last - first, n_splits)
    blk0 = first + split * per
    blk1 = tl.minimum(blk0 + per, last)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    g_ok = g < GROUP
    d_ok = d < head_dim
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    kv_base = cache_ptr + kvh.to(tl.int64) * stride_ch
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for blk in range(blk0, blk1):
        keys = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        rows, ok = attn.kv_rows(table_row, keys, lo, hi, max_pages, stride_cp, stride_ct, PAGE)
        k = tl.load(kv_base + rows[None, :] + d[:, None], mask=ok[None, :] & d_ok[:, None], other=0.0)
        if EARLY_V:
            v = attn.v_block(kv_base, stride_ckv, rows, ok, d, d_ok)
        s = attn.dot(q, k, tl.zeros([BLOCK_G, BLOCK_N], tl.float32), IEEE, INTERP) * qk_scale  # log2 units
        s = tl.where(ok[None, :], s, float("-inf"))
        if not EARLY_V:
            v = attn.v_block(kv_base, stride_ckv, rows, ok, d, d_ok)
        m_i, l_i, acc = attn.softmax_block(s, v, m_i, l_i, acc, IEEE, INTERP)
    acc = acc * attn.PV_UNSCALE
    row = (b.to(tl.int64) * n_heads + heads) * n_splits + split
    tl.store(m_ptr + row, m_i, mask=g_ok)
    tl.store(l_ptr + row, l_i, mask=g_ok)
    tl.store(acc_ptr + row[:, None] * head_dim + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
    queue.signal(done_ptr + b * kv_heads + kvh)


@triton.jit
def _merge_task(u, m_ptr, l_ptr, acc_ptr, g_ptr, bias_ptr, gated_ptr, split_done_ptr, gated_done_ptr, g_stride,
                n_heads, kv_heads, head_dim, n_splits, GROUP: tl.constexpr, MERGE_BLOCK_S: tl.constexpr,
                MERGE_BLOCK_D: tl.constexpr):
    """Task u of the merge-gate stage: MERGE_BLOCK_D columns of one token's query head, once its kv
    head's splits are all in."""
    chunks = tl.cdiv(head_dim, MERGE_BLOCK_D)
    token = (u // (n_heads * chunks)).to(tl.int64)
    head = (u // chunks) % n_heads
    d = (u % chunks) * MERGE_BLOCK_D + tl.arange(0, MERGE_BLOCK_D)
    d_ok = d < head_dim
    queue.wait_for(split_done_ptr + token * kv_heads + head // GROUP, n_splits)
    o = attn.merge_head(m_ptr, l_ptr, acc_ptr, (token * n_heads + head) * n_splits, n_splits, head_dim, d, d_ok,
                        MERGE_BLOCK_S, MERGE_BLOCK_D)
    gate_store(o, g_ptr, bias_ptr, gated_ptr, g_stride, token, head, n_heads, head_dim, d, d_ok)
    queue.signal(gated_done_ptr + token)


@triton.jit
def _o_proj_rows(v, n_o_proj, n_tokens, w_ptr, hidden, width, ROWS: tl.constexpr, K_P2: tl.constexpr):
    """Task v of the o_proj stage: its token, its rows, and its weight tile [ROWS, width] (nothing is
    read when v is not such a task)."""
    live = (v >= 0) & (v < n_o_proj)
    tile = tl.where(live, v // n_tokens, 0)
    token = tl.where(live, v % n_tokens, 0).to(tl.int64)
    rows = tile * ROWS + tl.arange(0, ROWS)
    k = tl.arange(0, K_P2)
    end = tl.where(live, hidden, 0)  # no rows past the last task (a scalar condition, as a bound)
    ok = (rows[:, None] < end) & (k[None, :] < width)
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * width + k[None, :], mask=ok, other=0.0)
    return token, rows, w


@triton.jit
def _tasks_kernel(q_ptr, cache_ptr, table_ptr, seq_lens_ptr, pos_ptr, g_ptr, bias_ptr, w_ptr, gated_ptr, y_ptr,
                  m_ptr, l_ptr, acc_ptr, queue_ptr,
                  stride_qn, stride_qh, stride_cp, stride_ckv, stride_ct, stride_ch, stride_tb, g_stride,
                  max_pages, window, qk_scale, n_tokens, n_heads, kv_heads, head_dim, hidden, n_splits,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr,
                  EARLY_V: tl.constexpr, MERGE_BLOCK_S: tl.constexpr, MERGE_BLOCK_D: tl.constexpr,
                  ROWS: tl.constexpr, K_P2: tl.constexpr, COUNTER_BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Every program loads the weight tile of its first o_proj task, takes attention and merge-gate
    tickets until the queue has none left, then runs its o_proj tasks (module docstring)."""
    pid, n_programs = tl.program_id(0), tl.num_programs(0)
    width = n_heads * head_dim
    n_attention = n_tokens * kv_heads * n_splits
    merged = n_heads * tl.cdiv(head_dim, MERGE_BLOCK_D)  # merge-gate tasks of a token
    n_queued = n_attention + n_tokens * merged
    n_o_proj = n_tokens * tl.cdiv(hidden, ROWS)
    # o_proj is never written: its tile is read before the PDL wait, while the last kernel finishes
    token, rows, w = _o_proj_rows(pid, n_o_proj, n_tokens, w_ptr, hidden, width, ROWS, K_P2)
    pdl_enter(PDL)  # q and the cache are the last kernel's; the queue is the last launch's until here
    split_done = queue.counters(queue_ptr)
    gated_done = split_done + n_tokens * kv_heads
    t = queue.take(queue_ptr)
    while t < n_queued:
        if t < n_attention:
            _attention_task(t, q_ptr, cache_ptr, table_ptr, seq_lens_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, split_done,
                            stride_qn, stride_qh, stride_cp, stride_ckv, stride_ct, stride_ch, stride_tb,
                            max_pages, window, qk_scale, n_heads, kv_heads, head_dim, n_splits,
                            GROUP, BLOCK_G, BLOCK_D, BLOCK_N, PAGE, HAS_WINDOW, IEEE, INTERP, EARLY_V)
        else:
            _merge_task(t - n_attention, m_ptr, l_ptr, acc_ptr, g_ptr, bias_ptr, gated_ptr, split_done, gated_done,
                        g_stride, n_heads, kv_heads, head_dim, n_splits, GROUP, MERGE_BLOCK_S, MERGE_BLOCK_D)
        t = queue.take(queue_ptr)
    # Every queued task is held by a running program now: the o_proj tasks pid, pid + programs, ... wait
    # only on those, with their weights in flight
    for v in range(pid, n_o_proj, n_programs):
        queue.wait_for(gated_done + token, merged)
        k = tl.arange(0, K_P2)
        x = tl.load(gated_ptr + token * width + k, mask=k < width, other=0.0, cache_modifier=".cg")
        y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        tl.store(y_ptr + token * hidden + rows, round_to(y, y_ptr.dtype.element_ty), mask=rows < hidden)
        token, rows, w = _o_proj_rows(v + n_programs, n_o_proj, n_tokens, w_ptr, hidden, width, ROWS, K_P2)
    queue.finish(queue_ptr, n_tokens * (kv_heads + 1), COUNTER_BLOCK)


def decode_tasks(q, cache, meta, g, bias, o_proj, *, window, scale, attention_cfg: dict, tasks_cfg: dict,
                 pdl: bool) -> torch.Tensor:
    """y [N, hidden] of a decode step (one query per sequence) in one launch: attention at
    `attention_cfg` (one of `attention_configs.TRITON_CONFIGS`: its splits, key block, EARLY_V), the
    launch at `tasks_cfg` (ROWS of o_proj a task, PER_SM programs a SM, num_warps). No host reads:
    every size is a shape, a config value or the SM count."""
    attn.check_inputs(q, cache, window)
    q = q if q.stride(-1) == 1 else q.contiguous()
    g = g if g.stride(-1) == 1 else g.contiguous()
    o_proj = o_proj if o_proj.stride(-1) == 1 else o_proj.contiguous()
    table = meta.page_table
    batch, max_pages = table.shape
    n, heads, hd = q.shape
    if n != batch:
        raise ValueError(f"decode needs one query per sequence: {n} queries, {batch} page-table rows")
    page, kv_heads = cache.shape[2], cache.shape[3]
    hidden, width = o_proj.shape
    splits = attn.decode_splits(batch, kv_heads, max_pages, page, window, attention_cfg, q.device)
    m = torch.empty((n, heads, splits), dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m)
    acc = torch.empty((n, heads, splits, hd), dtype=torch.float32, device=q.device)
    gated = torch.empty((n, width), dtype=q.dtype, device=q.device)
    y = torch.empty((n, hidden), dtype=q.dtype, device=q.device)
    merge_block_d = min(attn.MERGE_BLOCK_D, triton.next_power_of_2(hd))
    rows = tasks_cfg["ROWS"]
    tasks = n * (kv_heads * splits + heads * triton.cdiv(hd, merge_block_d) + triton.cdiv(hidden, rows))
    counters = queue.queue_counters(n * (kv_heads + 1), q.device, "attention_out_tasks")
    grid = (queue.programs(q.device, tasks_cfg["PER_SM"], tasks),)
    _tasks_kernel[grid](
        q, cache, table, meta.seq_lens, meta.positions, g, bias, o_proj, gated, y, m, l_part, acc, counters,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), table.stride(0),
        g.stride(0), max_pages, window or 0, scale * attn.LOG2E, n, heads, kv_heads, hd, hidden, splits,
        GROUP=heads // kv_heads, BLOCK_G=max(attn.MIN_DOT, triton.next_power_of_2(heads // kv_heads)),
        BLOCK_D=max(attn.MIN_DOT, triton.next_power_of_2(hd)), BLOCK_N=attention_cfg["BLOCK_N"], PAGE=page,
        HAS_WINDOW=window is not None, IEEE=q.dtype == torch.float32, INTERP=INTERPRETED,
        EARLY_V=attention_cfg["EARLY_V"], MERGE_BLOCK_S=min(attn.MERGE_MAX_SPLITS, triton.next_power_of_2(splits)),
        MERGE_BLOCK_D=merge_block_d, ROWS=rows, K_P2=triton.next_power_of_2(width), COUNTER_BLOCK=COUNTER_BLOCK,
        num_warps=tasks_cfg["num_warps"], num_stages=1, **pdl_launch(pdl))
    return y
