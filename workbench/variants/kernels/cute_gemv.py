"""The CuTe DSL kernel of `qkvg_proj:cute`: y = x @ W^T for 1-16 token rows, read at HBM speed.

Imported only by the variant's first call (`qkvg_proj/cute.py` imports without cutlass, which is optional);
never import it from anywhere else. x [M, K] and W [N, K] are bf16 or fp16, M <= 16, K a multiple of 8;
products are summed in FP32 and rounded once to the model dtype, as the reference's GEMMs round.

At decode the cost is streaming W from HBM once, so the layout is for bandwidth. Each warp owns
`rows_per_warp` whole rows of W (a CTA `rows_per_warp * num_warps` of them) and streams them with
16-byte loads (8 values): vector j of a row belongs to lane j % 32. Per step a lane issues
`unroll * rows_per_warp` W loads before it uses any, which is what keeps enough bytes in flight with
only N / rows_per_warp warps in the grid. x is read with the same 16-byte vectors (from L1 after the
first warp of an SM) and used for every row of the warp. Each lane keeps M * rows_per_warp FP32 sums;
the warp adds them with butterfly shuffles (all 32 lanes active: the K loop has no early exit), lane m
stores token m. No shared memory, no atomics, no split-K: the order of the sums is fixed, so the
result is the same bits on every call.

Outputs are segment-major, as the Triton GEMV writes them: with `splits` (q, k, v, gate widths) each
segment is its own contiguous [M, width] block of one buffer, so the four outputs are views without a
copy. M is a compile-time constant (the per-lane sums are registers): one compilation per token count,
dtype, shape and tuning config, cached here. Calls launch on torch's current stream and neither sync
nor allocate beyond the output buffer, so they can be captured in a CUDA graph after a first
(compiling, module-loading) call outside the capture.
"""

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import from_dlpack

from workbench.variants.kernels.cute_common import VEC

ALIGN = 16
WARP = 32
MAX_M = 16


class GemvKernel:
    """The kernel at one specialisation: m tokens, k = hidden, n output rows cut into segments at
    `bounds` (three segment starts; n where there are fewer segments)."""

    def __init__(self, m: int, k: int, n: int, bounds: tuple[int, int, int], rows_per_warp: int,
                 num_warps: int, unroll: int):
        self.m, self.k, self.n, self.bounds = m, k, n, bounds
        self.rows = rows_per_warp
        self.num_warps = num_warps
        self.cta_rows = rows_per_warp * num_warps
        self.vectors = k // VEC  # 16-byte vectors in a row
        per_lane = math.ceil(self.vectors / WARP)
        self.unroll = min(unroll, per_lane)
        self.steps = math.ceil(per_lane / self.unroll)
        # Whether every step's vectors lie inside the row (then the loads need no predicate).
        self.exact = self.vectors % (WARP * self.unroll) == 0

    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, out: cute.Tensor, stream: cuda.CUstream):
        self.kernel(x, w, out).launch(grid=[math.ceil(self.n / self.cta_rows), 1, 1],
                                      block=[WARP * self.num_warps, 1, 1], stream=stream)

    def _vectors(self, t: cute.Tensor, row) -> cute.Tensor:
        """Row `row` of `t` as (VEC, lane, unroll, step): [:, l, u, s] is vector l + 32 * (s * unroll + u).
        Static strides, so each vector's 16-byte alignment is known (K is a multiple of VEC)."""
        layout = cute.make_layout((VEC, WARP, self.unroll, self.steps),
                                  stride=(1, VEC, VEC * WARP, VEC * WARP * self.unroll))
        return cute.make_tensor(t[row, None].iterator, layout)

    @cute.jit
    def _load_w(self, w_rows: list, wq: cute.Tensor, lane, s):
        """Step s's W vectors of this lane, every row of the warp, into registers (zeros past the row)."""
        if cutlass.const_expr(not self.exact):
            wq.fill(0)
        for u in cutlass.range_constexpr(self.unroll):
            for r in cutlass.range_constexpr(self.rows):
                if cutlass.const_expr(self.exact):
                    cute.autovec_copy(w_rows[r][None, lane, u, s], wq[None, u, r])
                elif lane + WARP * (s * self.unroll + u) < self.vectors:
                    cute.autovec_copy(w_rows[r][None, lane, u, s], wq[None, u, r])

    @cute.jit
    def _accumulate(self, x_rows: list, wq: cute.Tensor, acc: cute.Tensor, lane, s):
        """acc[m, r] += x[m] . w[r] over step s's vectors of this lane, in FP32."""
        for u in cutlass.range_constexpr(self.unroll):
            wf = cute.make_rmem_tensor((VEC, self.rows), cutlass.Float32)
            wf.store(wq[None, u, None].load().to(cutlass.Float32))
            for m in cutlass.range_constexpr(self.m):
                xq = cute.make_rmem_tensor((VEC,), x_rows[m].element_type)
                if cutlass.const_expr(self.exact):
                    cute.autovec_copy(x_rows[m][None, lane, u, s], xq)
                else:
                    xq.fill(0)
                    if lane + WARP * (s * self.unroll + u) < self.vectors:
                        cute.autovec_copy(x_rows[m][None, lane, u, s], xq)
                xf = cute.make_rmem_tensor((VEC,), cutlass.Float32)
                xf.store(xq.load().to(cutlass.Float32))
                for r in cutlass.range_constexpr(self.rows):
                    total = acc[m, r]
                    for e in cutlass.range_constexpr(VEC):
                        total = total + xf[e] * wf[e, r]
                    acc[m, r] = total

    @cute.kernel
    def kernel(self, x: cute.Tensor, w: cute.Tensor, out: cute.Tensor):
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        bidx, _, _ = cute.arch.block_idx()
        first = bidx * self.cta_rows + warp * self.rows

        w_rows = []
        for r in cutlass.range_constexpr(self.rows):
            row = first + r
            if cutlass.const_expr(self.n % self.cta_rows != 0):
                # Rows past N (last CTA only) read row N-1 again; their results are never stored.
                row = cutlass.min(row, self.n - 1)
            w_rows.append(self._vectors(w, row))
        x_rows = []
        for m in cutlass.range_constexpr(self.m):
            x_rows.append(self._vectors(x, m))

        acc = cute.make_rmem_tensor((self.m, self.rows), cutlass.Float32)
        acc.fill(0.0)
        # Software-pipelined by hand: the W loads of step s + 1 are issued before the sums of step s,
        # so they stay in flight while it computes (left to itself, ptxas sinks each load next to its
        # first use and keeps only ~4 in flight per lane).
        cur = cute.make_rmem_tensor((VEC, self.unroll, self.rows), w.element_type)
        self._load_w(w_rows, cur, lane, 0)
        for s in cutlass.range(self.steps - 1, unroll=1):
            nxt = cute.make_rmem_tensor((VEC, self.unroll, self.rows), w.element_type)
            self._load_w(w_rows, nxt, lane, s + 1)
            self._accumulate(x_rows, cur, acc, lane, s)
            cur.store(nxt.load())
        self._accumulate(x_rows, cur, acc, lane, self.steps - 1)

        b1, b2, b3 = self.bounds
        for r in cutlass.range_constexpr(self.rows):
            # The sums of this row, all in every lane; lane m keeps token m's.
            mine = cutlass.Float32(0.0)
            for m in cutlass.range_constexpr(self.m):
                total = acc[m, r]
                for i in cutlass.range_constexpr(5):
                    total = total + cute.arch.shuffle_sync_bfly(total, offset=16 >> i)
                if lane == m:
                    mine = total
            row = first + r
            # Segment-major: column `row` of segment [start, start + width) goes to
            # out[start * M + token * width + row - start].
            start = cutlass.Int32(0)
            width = cutlass.Int32(b1)
            if row >= b1:
                start, width = cutlass.Int32(b1), cutlass.Int32(b2 - b1)
            if row >= b2:
                start, width = cutlass.Int32(b2), cutlass.Int32(b3 - b2)
            if row >= b3:
                start, width = cutlass.Int32(b3), cutlass.Int32(self.n - b3)
            if lane < self.m and row < self.n:
                out[start * self.m + lane * width + row - start] = mine.to(out.element_type)


_COMPILED: dict[tuple, object] = {}


def _tensor(t: torch.Tensor):
    """A cute view of a dense tensor with static shape and strides (each compilation is for one shape)."""
    return from_dlpack(t, assumed_align=ALIGN)


def linear(x: torch.Tensor, w: torch.Tensor, splits: tuple[int, ...] | None = None, *, rows_per_warp: int,
           num_warps: int, unroll: int):
    """x [M, K] @ w.T for M <= 16; w [N, K] dense and 16-byte aligned (a prepared weight). `splits`:
    output widths summing to N (at most 4): one contiguous [M, width] view per split of one buffer;
    without it, the [M, N] result."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= MAX_M and k % VEC == 0 and w.shape[1] == k and x.dtype == w.dtype, (x.shape, w.shape, x.dtype, w.dtype)
    assert w.is_contiguous() and w.data_ptr() % ALIGN == 0, "the packed weight must be dense and 16-byte aligned"
    assert n * k < 2 ** 31, "32-bit element offsets"
    if not (x.is_contiguous() and x.data_ptr() % ALIGN == 0):
        x = x.clone(memory_format=torch.contiguous_format)  # fresh memory: dense and aligned
    out = torch.empty(m * n, dtype=x.dtype, device=x.device)
    bounds = [n] * 3
    if splits:
        assert sum(splits) == n and len(splits) <= 4, (splits, n)
        bounds = [min(sum(splits[:i]), n) if i < len(splits) else n for i in (1, 2, 3)]
    if m > 0:
        key = (x.dtype, m, k, n, tuple(bounds), rows_per_warp, num_warps, unroll)
        args = (_tensor(x), _tensor(w), _tensor(out))
        stream = cuda.CUstream(torch.cuda.current_stream(x.device).cuda_stream)
        compiled = _COMPILED.get(key)
        if compiled is None:
            kernel = GemvKernel(m, k, n, tuple(bounds), rows_per_warp, num_warps, unroll)
            compiled = _COMPILED[key] = cute.compile(kernel, *args, stream)
        compiled(*args, stream)
    if not splits:
        return out.view(m, n)
    return tuple(out[m * b:m * (b + s)].view(m, s) for b, s in zip([0, *bounds], splits))
