"""Hand-built paged attention cases shared by the attention variant tests (Triton, FlashInfer)."""

import dataclasses
import math

import torch

from beam_model.kv_cache import AttentionMetadata

NAN = float("nan")


def _case(ctx_before, new, *, heads, kv_heads, hd, page, window, dtype, seed=0, extra_pages=3,
          poison_window=True, device="cpu"):
    """A paged cache holding len(new) sequences of ctx_before[b] + new[b] tokens on scattered pages.

    Slots outside every sequence's live rows are NaN. On sliding layers (window set) pages entirely
    before the first query's window are released (-1 in the table, NaN in the cache) as the cache
    does; with `poison_window` the out-of-window rows of held pages are NaN too. The table is wider
    than any sequence needs (-1 padding)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in zip(ctx_before, new)]
    need = [math.ceil(n / page) for n in lens]
    n_pages = sum(need) + extra_pages + 1
    cache = torch.full((n_pages, 2, page, kv_heads, hd), NAN)
    ids = (1 + torch.randperm(n_pages - 1, generator=gen)).tolist()  # page 0 reserved, as in the cache
    table = torch.full((len(lens), max(need) + 2), -1, dtype=torch.int32)
    for b, (c, length) in enumerate(zip(ctx_before, lens)):
        first_seen = max(0, c - window + 1) if window is not None else 0  # the chunk's first query
        for i in range(need[b]):
            pid = ids.pop()
            if (i + 1) * page <= first_seen:
                continue  # released: -1, the page stays NaN
            table[b, i] = pid
            rows = torch.arange(i * page, (i + 1) * page)
            live = rows < length
            if poison_window:
                live &= rows >= first_seen
            cache[pid, :, live] = torch.randn(2, int(live.sum()), kv_heads, hd, generator=gen)
    positions = torch.tensor([p for c, n in zip(ctx_before, new) for p in range(c, c + n)], dtype=torch.int64)
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    q = 2 * torch.randn(len(positions), heads, hd, generator=gen)  # scores of a few units, as after SSMax
    meta = AttentionMetadata(
        positions=positions.to(device), seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start=torch.tensor(starts, dtype=torch.int32, device=device), page_table=table.to(device),
        slot_mapping=torch.zeros(len(positions), dtype=torch.int64, device=device), page_size=page,
        decode=all(n == 1 for n in new), query_start_host=starts, seq_lens_host=lens)
    return q.to(device, dtype), cache.to(device, dtype), meta


def _ulps(out, ref):
    def ordered(x):
        bits = x.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(out) - ordered(ref)).abs()


def _assert_close(out, ref, label):
    """FP32: within the point's tolerance of the reference. 16-bit: the reference's single rounding
    of an FP32 result, so at most 1 ulp apart where the two FP32 sums straddle a rounding boundary."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, label
    assert torch.isfinite(out).all(), f"{label}: NaN/Inf in the output (a masked row leaked)"
    if out.dtype == torch.float32:
        err = ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
        assert err <= 1e-5, f"{label}: rel err {err:.2e}"
    else:
        ulps = _ulps(out, ref)
        assert ulps.max() <= 1, f"{label}: {int((ulps > 1).sum())} elements > 1 ulp from the reference"
        assert (ulps > 0).float().mean() <= 0.03, f"{label}: {int((ulps > 0).sum())} of {ulps.numel()} 1 ulp off"


# Two TP8 decode steps (8 sequences, 6 query heads on 1 KV head, head_dim 128, 64-token pages) with
# different lengths, for capturing a step and replaying it with the other's contents.
REPLAY_CONTEXTS = ([4095, 30, 700, 2000, 1, 63, 64, 3000], [2100, 4000, 64, 5, 999, 1500, 0, 4096])


def check_graph_replay(fn, window, *, poison: bool, before_replay=lambda meta: None, label=""):
    """Capture `fn` on one decode step, refill the captured tensors (and the host lengths) with each
    step in turn, call `before_replay(meta)`, replay: the output must follow the new contents.
    poison: pages not held are -1 in the table and NaN in the cache (else page 0 and finite data)."""
    from workbench import registry

    dev, dtype, b, scale = torch.device("cuda"), torch.bfloat16, 8, 128 ** -0.5
    steps = [_case(ctx, [1] * b, heads=6, kv_heads=1, hd=128, page=64, window=window, dtype=dtype, seed=i,
                   device=dev, poison_window=False) for i, ctx in enumerate(REPLAY_CONTEXTS)]
    n_pages = max(cache.shape[0] for _, cache, _ in steps)
    width = max(meta.page_table.shape[1] for _, _, meta in steps)
    q0, _, meta0 = steps[0]
    qs = torch.empty_like(q0)
    cs = torch.empty((n_pages, *steps[0][1].shape[1:]), dtype=dtype, device=dev)
    live = dataclasses.replace(meta0, page_table=torch.empty((b, width), dtype=torch.int32, device=dev),
                               seq_lens=meta0.seq_lens.clone(), positions=meta0.positions.clone(),
                               seq_lens_host=list(meta0.seq_lens_host))

    def load(i):
        q, cache, meta = steps[i]
        qs.copy_(q)
        cs.fill_(NAN if poison else 0.0)
        cs[:cache.shape[0]].copy_(cache if poison else cache.nan_to_num())
        live.page_table.fill_(-1 if poison else 0)
        live.page_table[:, :meta.page_table.shape[1]].copy_(meta.page_table if poison else meta.page_table.clamp(min=0))
        live.seq_lens.copy_(meta.seq_lens)
        live.positions.copy_(meta.positions)
        live.seq_lens_host[:] = meta.seq_lens_host

    load(0)
    fn(qs, cs, live, window=window, scale=scale)  # compiles / plans outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(qs, cs, live, window=window, scale=scale)
    for i in (1, 0):
        load(i)
        before_replay(live)
        graph.replay()
        torch.cuda.synchronize()
        want = registry.reference("attention").fn(qs, cs, live, window=window, scale=scale)
        err = ((out.float() - want.float()).norm() / want.float().norm()).item()
        assert torch.isfinite(out).all() and err <= 6e-3, (label, i, err)
