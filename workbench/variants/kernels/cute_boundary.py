"""The CuTe DSL kernel of `boundary:cute`: post-norm, depth-scaled residual and next pre-norm of a row.

Imported only by the variant's first call (`boundary/cute.py` imports without cutlass, which is optional);
never import it from anywhere else. The math is the reference's, step for step in FP32: RMSNorm(y),
a*h + b*(.), one rounding to the model dtype (h_new as stored), RMSNorm(h_new), one rounding (x_next).

One CTA per token row. Each thread owns whole 16-byte vectors (8 bf16 / fp16 values) of the row, so
every global load and store is 128 bits wide; vector j of a row belongs to thread j % threads. The row
stays in registers between the two norms: y and h are read once, h_new and x_next written once. The
sums of squares go through a butterfly-shuffle warp reduction, then across warps through shared memory.

A compiled kernel is specialised on dtypes, hidden size, threads per row and whether a next norm
follows, and cached here; the token count is a runtime argument, so one compilation serves decode and
prefill. Calls launch on torch's current stream and neither sync nor allocate beyond the two outputs,
so they can be captured in a CUDA graph (after a first, compiling call outside the capture).
"""

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import from_dlpack

from workbench.variants.kernels.cute_common import VEC

ALIGN = 16


class BoundaryKernel:
    """The kernel at one specialisation. `hidden` must be a multiple of VEC."""

    def __init__(self, hidden: int, num_warps: int, has_next: bool):
        self.hidden = hidden
        self.num_warps = num_warps
        self.threads = 32 * num_warps
        self.vectors = hidden // VEC
        self.per_thread = math.ceil(self.vectors / self.threads)  # per thread; the last ones may lie past the row
        self.has_next = has_next

    @cute.jit
    def __call__(self, y: cute.Tensor, h: cute.Tensor, post_w: cute.Tensor, next_w: cute.Tensor,
                 residual: cute.Tensor, h_out: cute.Tensor, x_out: cute.Tensor, eps: cutlass.Float32,
                 stream: cuda.CUstream):
        self.kernel(y, h, post_w, next_w, residual, h_out, x_out, eps).launch(
            grid=[y.shape[0], 1, 1], block=[self.threads, 1, 1], stream=stream)

    def _vectors(self, t: cute.Tensor, row) -> cute.Tensor:
        """Row `row` of `t` (or `t` itself if 1-D) viewed as (VEC, threads, per_thread): [:, i, k] is the
        k-th vector of thread i. Strides are static so the 16-byte alignment of each vector is known."""
        start = t.iterator if row is None else t[row, None].iterator  # a slice keeps the alignment known
        layout = cute.make_layout((VEC, self.threads, self.per_thread), stride=(1, VEC, VEC * self.threads))
        return cute.make_tensor(start, layout)

    @cute.jit
    def _load(self, t: cute.Tensor, row, tidx):
        """This thread's vectors of a row in registers, as FP32 (zeros where the row has ended)."""
        src = self._vectors(t, row)
        frag = cute.make_rmem_tensor((VEC, self.per_thread), t.element_type)
        frag.fill(0)
        for k in cutlass.range_constexpr(self.per_thread):
            if cutlass.const_expr(self.vectors % self.threads == 0):
                cute.autovec_copy(src[None, tidx, k], frag[None, k])
            else:
                if tidx + k * self.threads < self.vectors:
                    cute.autovec_copy(src[None, tidx, k], frag[None, k])
        return frag.load().to(cutlass.Float32)

    @cute.jit
    def _store(self, values, t: cute.Tensor, row, tidx):
        """Write this thread's vectors of a row (`values`: TensorSSA already in t's dtype)."""
        dst = self._vectors(t, row)
        frag = cute.make_rmem_tensor((VEC, self.per_thread), t.element_type)
        frag.store(values)
        for k in cutlass.range_constexpr(self.per_thread):
            if cutlass.const_expr(self.vectors % self.threads == 0):
                cute.autovec_copy(frag[None, k], dst[None, tidx, k])
            else:
                if tidx + k * self.threads < self.vectors:
                    cute.autovec_copy(frag[None, k], dst[None, tidx, k])

    @cute.jit
    def _warp_sum(self, value: cutlass.Float32) -> cutlass.Float32:
        for shift in cutlass.range_constexpr(5):
            value = value + cute.arch.shuffle_sync_bfly(value, offset=16 >> shift)
        return value

    @cute.jit
    def _row_sum(self, value: cutlass.Float32, partials: cute.Tensor) -> cutlass.Float32:
        """The sum of `value` over the CTA, in every thread. `partials`: num_warps FP32 of shared memory
        that no other reduction uses (so no barrier is needed before writing it)."""
        value = self._warp_sum(value)
        if cutlass.const_expr(self.num_warps > 1):
            lane = cute.arch.lane_idx()
            # warp_idx() is a warp-wide shuffle (make_warp_uniform): every lane must reach it. Inside
            # `if lane == 0` one lane waited for the other 31 forever: the kernel hung with > 1 warp.
            warp = cute.arch.warp_idx()
            if lane == 0:
                partials[warp] = value
            cute.arch.sync_threads()
            part = cutlass.Float32(0.0)
            if lane < self.num_warps:
                part = partials[lane]
            value = self._warp_sum(part)
        return value

    @cute.jit
    def _rms(self, x, partials: cute.Tensor, eps: cutlass.Float32) -> cutlass.Float32:
        """rsqrt(mean(x^2) + eps) of the row whose share in this thread is `x` (FP32 TensorSSA)."""
        squares = (x * x).reduce(cute.ReductionOp.ADD, cutlass.Float32(0.0), reduction_profile=0)
        total = self._row_sum(squares, partials)
        return cute.math.rsqrt(total / cutlass.Float32(self.hidden) + eps)

    @cute.kernel
    def kernel(self, y: cute.Tensor, h: cute.Tensor, post_w: cute.Tensor, next_w: cute.Tensor,
               residual: cute.Tensor, h_out: cute.Tensor, x_out: cute.Tensor, eps: cutlass.Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = cutlass.Int64(bidx)  # row * hidden overflows 32 bits past ~400K tokens at hidden 5120

        smem = cutlass.memory.SmemAllocator()
        partials = smem.allocate_tensor(cutlass.Float32, cute.make_layout((self.num_warps, 2)), byte_alignment=16)

        a = residual[0].to(cutlass.Float32)  # read on the device: no host sync, one kernel for all 104 sites
        b = residual[1].to(cutlass.Float32)
        yf = self._load(y, row, tidx)
        hf = self._load(h, row, tidx)
        r = self._rms(yf, partials[None, 0], eps)
        h_new = (a * hf + b * ((yf * r) * self._load(post_w, None, tidx))).to(h_out.element_type)
        self._store(h_new, h_out, row, tidx)
        if cutlass.const_expr(self.has_next):
            hn = h_new.to(cutlass.Float32)  # the norm of h_new as stored, as in the reference
            rn = self._rms(hn, partials[None, 1], eps)
            x_next = ((hn * rn) * self._load(next_w, None, tidx)).to(x_out.element_type)
            self._store(x_next, x_out, row, tidx)


_COMPILED: dict[tuple, object] = {}


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` if its rows are dense and 16-byte aligned (the kernel's vector accesses need both), else a copy."""
    ok = t.is_contiguous() and t.data_ptr() % ALIGN == 0
    return t if ok else t.clone(memory_format=torch.contiguous_format)


def _rows(t: torch.Tensor):
    """A dense [N, hidden] tensor for the kernel: N dynamic (one compilation for every token count), hidden
    static. The stride order is spelled out: `t.dim_order()` costs ~170 us a call."""
    return from_dlpack(t, assumed_align=ALIGN).mark_compact_shape_dynamic(mode=0, stride_order=(0, 1))


def boundary(y, h, post_w, next_w, residual, *, eps: float, num_warps: int):
    """h_new, x_next (None without `next_w`) for y, h [N, hidden]; the caller has done the all-reduce."""
    y, h, post_w = _aligned(y), _aligned(h), _aligned(post_w)
    n, hidden = h.shape
    h_new = torch.empty((n, hidden), dtype=h.dtype, device=h.device)
    x_next = None if next_w is None else torch.empty_like(h_new)
    if n == 0:
        return h_new, x_next
    next_w = post_w if next_w is None else _aligned(next_w)  # a stand-in the kernel never reads
    residual = residual if residual.is_contiguous() else residual.contiguous()
    args = (_rows(y), _rows(h), from_dlpack(post_w, assumed_align=ALIGN), from_dlpack(next_w, assumed_align=ALIGN),
            from_dlpack(residual), _rows(h_new), _rows(h_new if x_next is None else x_next))
    key = (y.dtype, h.dtype, post_w.dtype, next_w.dtype, residual.dtype, hidden, num_warps, x_next is not None)
    compiled = _COMPILED.get(key)
    stream = cuda.CUstream(torch.cuda.current_stream(h.device).cuda_stream)
    if compiled is None:
        kernel = BoundaryKernel(hidden, num_warps, has_next=x_next is not None)
        compiled = _COMPILED[key] = cute.compile(kernel, *args, cutlass.Float32(eps), stream)
    compiled(*args, eps, stream)
    return h_new, x_next
