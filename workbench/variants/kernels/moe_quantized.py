"""Decode GEMV kernels of `experts:triton_quantized`: the `experts` contract (`workbench/variants/experts/
__init__.py`) on expert weights stored as FP8 or NVFP4 (`beam_model/quant/tensors.py`), read as stored.

Weight-only quantization: x, the activation and y stay in the model dtype; each program loads the quantized
bytes of its own expert only and dequantizes them in registers, so a decode step moves the stored bytes
and never a dequantized copy. One constexpr (`NVFP4`) picks the format in each kernel:
- FP8 (one scale an output row): the E4M3 values are converted to FP32 and FMA'd against x; the row's
  scale multiplies the row's sum once, after the loop.
- NVFP4 (one E4M3 scale a block of 16 inputs, one FP32 scale_2 an expert): a step loads [rows, blocks, 8]
  bytes, each byte two E2M1 codes (the even input in the low nibble), decoded arithmetically (no table)
  to 4 x their value, an exact small integer. Each block's 16 products are summed, then times the block's
  scale (one scale load a block, not a byte); scale_2 and the 1/4 multiply the row's sum once.

Two kernels, as experts:triton's GEMV path (`kernels/moe.py`): one program per routed (token, k) pair x a
block of ff rows computes gate, up and SwiGLU (activation in FP32, rounded once to the model dtype); then one
program per token x a block of hidden rows runs the down projection over all top_k experts, applies the
routing weights and combines in FP32, rounded once. Every output element is written by one program, in a
fixed order, with no atomics: results are bitwise identical run to run.

The kernels serve any number of pairs (each pair re-reads its expert, so a prefill is correct but slow); the
variant declines prefill sizes so the search times it only at decode. Imported on the variant's first call,
so the point imports without triton and TRITON_INTERPRET can be set before these kernels are defined.
"""

import torch
import triton
import triton.language as tl

from workbench.variants.kernels.moe import swiglu_store
from workbench.variants.kernels.triton_common import pdl_enter, pdl_launch, round_to

FORMATS = ("fp8", "nvfp4")


@triton.jit
def nvfp4_block(packed, x, scale):
    """Scale blocks of NVFP4 weights against their inputs: `packed` [..., blocks, 8] bytes (uint8), `x`
    [..., blocks, 8, 2] their inputs (the low nibble's first), `scale` [..., blocks] -> [..., blocks]: each
    block's 16 products summed, times its scale, all times 4 and without scale_2 (the caller applies both).

    A code's bit 3 is the sign, bits 0-2 (exponent e, mantissa m): the value is m / 2 where e == 0, else
    (2 + m) * 2^(e - 2). Times 4 it is an integer (0, 2, 4, 6, 8, 12, 16, 24), decoded here with integer
    ops and converted exactly."""
    q = packed.to(tl.int32)
    code = tl.join(q & 15, q >> 4)
    mag = code & 7
    e = mag >> 1
    m = mag & 1
    n = tl.where(e == 0, 2 * m, (2 + m) << e)
    w = tl.where((code & 8) != 0, -n, n).to(tl.float32)
    return tl.sum(tl.sum(w * x, axis=-1), axis=-1) * scale.to(tl.float32)


@triton.jit
def gate_up_quantized_kernel(x_ptr, ids_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, sg2_ptr, su2_ptr, act_ptr, HIDDEN, FF,
                             stride_we, stride_wf, stride_se, stride_sf, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, NVFP4: tl.constexpr, PDL: tl.constexpr = False):
    """act[pair, n-block] = silu(x[token] @ gate[e].T) * (x[token] @ up[e].T), e = ids[pair], the weights
    dequantized in registers. FP32 tiles of products (NVFP4: of scaled block sums), reduced once after the loop."""
    pdl_enter(PDL)  # the expert id (and so every weight address) comes from the previous kernel
    pair = tl.program_id(0)
    token = (pair // TOP_K).to(tl.int64)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < FF  # rows past FF would be the next expert's: never read
    x_row = x_ptr + token * HIDDEN
    if NVFP4:
        # a step is NB = BLOCK_K / 16 scale blocks of 8 bytes; byte j holds inputs 2j (low nibble) and 2j + 1
        NB: tl.constexpr = BLOCK_K // 16
        offs_s = tl.arange(0, NB)
        offs_b = offs_s[:, None] * 8 + tl.arange(0, 8)[None, :]  # [NB, 8] bytes of the step
        pair_in = tl.arange(0, 2)[None, None, :]  # a byte's two inputs
        w_off = e * stride_we + offs_n[:, None, None] * stride_wf + offs_b[None, :, :]
        s_off = e * stride_se + offs_n[:, None] * stride_sf + offs_s[None, :]
        acc_g = tl.zeros([BLOCK_N, NB], tl.float32)
        acc_u = tl.zeros([BLOCK_N, NB], tl.float32)
        for b0 in range(0, HIDDEN // 2, BLOCK_K // 2):
            b_ok = offs_b + b0 < HIDDEN // 2
            s_ok = n_ok[:, None] & (offs_s + b0 // 8 < HIDDEN // 16)[None, :]
            x_ptrs = x_row + 2 * (b0 + offs_b)[:, :, None] + pair_in
            xk = tl.load(x_ptrs, mask=b_ok[:, :, None], other=0.0).to(tl.float32)[None, :, :, :]
            m = n_ok[:, None, None] & b_ok[None, :, :]
            acc_g += nvfp4_block(tl.load(wg_ptr + w_off + b0, mask=m, other=0), xk,
                                 tl.load(sg_ptr + s_off + b0 // 8, mask=s_ok, other=0.0))
            acc_u += nvfp4_block(tl.load(wu_ptr + w_off + b0, mask=m, other=0), xk,
                                 tl.load(su_ptr + s_off + b0 // 8, mask=s_ok, other=0.0))
        g = tl.sum(acc_g, axis=1) * (tl.load(sg2_ptr + e) * 0.25)
        u = tl.sum(acc_u, axis=1) * (tl.load(su2_ptr + e) * 0.25)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        w_off = e * stride_we + offs_n[:, None] * stride_wf + offs_k[None, :]
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            k_ok = offs_k + k0 < HIDDEN
            xk = tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            m = n_ok[:, None] & k_ok[None, :]
            acc_g += tl.load(wg_ptr + w_off + k0, mask=m, other=0.0).to(tl.float32) * xk
            acc_u += tl.load(wu_ptr + w_off + k0, mask=m, other=0.0).to(tl.float32) * xk
        s_off = e * stride_se + offs_n * stride_sf
        g = tl.sum(acc_g, axis=1) * tl.load(sg_ptr + s_off, mask=n_ok, other=0.0)
        u = tl.sum(acc_u, axis=1) * tl.load(su_ptr + s_off, mask=n_ok, other=0.0)
    swiglu_store(g, u, act_ptr + pair.to(tl.int64) * FF + offs_n, n_ok)


@triton.jit
def down_quantized_kernel(act_ptr, ids_ptr, rw_ptr, wd_ptr, sd_ptr, sd2_ptr, y_ptr, HIDDEN, FF, stride_we, stride_wh,
                          stride_se, stride_sh, TOP_K: tl.constexpr, K_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, NVFP4: tl.constexpr, PDL: tl.constexpr = False):
    """y[token, n-block] = sum_k rw[token, k] * (act[token, k] @ down[ids[token, k]].T), rounded once.

    One program owns its output rows across all top_k experts (one [top_k, BLOCK_N, BLOCK_K] tile a step:
    top_k independent loads in flight), so the weighted combine is FP32 registers in a fixed order. Each
    expert's row sums take its scales (and the routing weight) once, after the loop."""
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < HIDDEN
    slot = tl.arange(0, K_P2)
    slot_ok = slot < TOP_K
    pairs = token * TOP_K + slot
    e = tl.load(ids_ptr + pairs, mask=slot_ok, other=0).to(tl.int64)
    rw = tl.load(rw_ptr + pairs, mask=slot_ok, other=0.0)
    a_row = act_ptr + pairs[:, None] * FF
    w_ok = slot_ok[:, None, None] & n_ok[None, :, None]
    if NVFP4:
        # [top_k, BLOCK_N, NB, 8] bytes a step, as in the gate/up kernel
        NB: tl.constexpr = BLOCK_K // 16
        offs_s = tl.arange(0, NB)
        offs_b = (offs_s[:, None] * 8 + tl.arange(0, 8)[None, :])[None, :, :]  # [1, NB, 8]
        w_off = e[:, None, None, None] * stride_we + offs_n[None, :, None, None] * stride_wh + offs_b[:, None, :, :]
        s_off = e[:, None, None] * stride_se + offs_n[None, :, None] * stride_sh + offs_s[None, None, :]
        a_row = a_row[:, :, None]  # [top_k, 1, 1]
        acc = tl.zeros([K_P2, BLOCK_N, NB], tl.float32)
        for b0 in range(0, FF // 2, BLOCK_K // 2):
            b_ok = offs_b + b0 < FF // 2
            a_ok = slot_ok[:, None, None] & b_ok
            a_ptrs = a_row[:, :, :, None] + 2 * (b0 + offs_b)[:, :, :, None] + tl.arange(0, 2)[None, None, None, :]
            a = tl.load(a_ptrs, mask=a_ok[:, :, :, None], other=0.0).to(tl.float32)[:, None, :, :, :]
            wd = tl.load(wd_ptr + w_off + b0, mask=w_ok[:, :, :, None] & b_ok[:, None, :, :], other=0)
            s_ok = w_ok & (offs_s + b0 // 8 < FF // 16)[None, None, :]
            acc += nvfp4_block(wd, a, tl.load(sd_ptr + s_off + b0 // 8, mask=s_ok, other=0.0))
        per_slot = rw * tl.load(sd2_ptr + e, mask=slot_ok, other=0.0) * 0.25
        rows = tl.sum(acc, axis=2) * per_slot[:, None]
    else:
        offs_f = tl.arange(0, BLOCK_K)
        w_off = e[:, None, None] * stride_we + offs_n[None, :, None] * stride_wh + offs_f[None, None, :]
        acc = tl.zeros([K_P2, BLOCK_N, BLOCK_K], tl.float32)
        for f0 in range(0, FF, BLOCK_K):
            f_ok = offs_f + f0 < FF
            a = tl.load(a_row + f0 + offs_f[None, :], mask=slot_ok[:, None] & f_ok[None, :], other=0.0)
            wd = tl.load(wd_ptr + w_off + f0, mask=w_ok & f_ok[None, None, :], other=0.0)
            acc += wd.to(tl.float32) * a.to(tl.float32)[:, None, :]
        s_ok = slot_ok[:, None] & n_ok[None, :]
        row_scale = tl.load(sd_ptr + e[:, None] * stride_se + offs_n[None, :] * stride_sh, mask=s_ok, other=0.0)
        rows = tl.sum(acc, axis=2) * row_scale * rw[:, None]
    y = round_to(tl.sum(rows, axis=0), y_ptr.dtype.element_ty)
    tl.store(y_ptr + token * HIDDEN + offs_n, y, mask=n_ok)


# ---- entry point -----------------------------------------------------------------------------------

def _parts(w, fmt: str):
    """(stored weight, scale, scale_2 or the scale again as an unused pointer) of one projection."""
    return (w.weight, w.scale, w.scale_2) if fmt == "nvfp4" else (w.weight, w.scale, w.scale)


def checked_weights(w: dict, qualname: str = "experts:triton_quantized") -> tuple[str, tuple, tuple, tuple]:
    """(format, gate parts, up parts, down parts) as the kernels read them: one quantized format for all
    three, every tensor (scale_2 too) contiguous along its last dim, gate and up with one set of strides
    (the kernel takes one)."""
    fmts = {getattr(w[k], "format", "bf16") for k in ("gate_proj", "up_proj", "down_proj")}
    fmt = fmts.pop() if len(fmts) == 1 else None
    if fmt not in FORMATS:
        raise ValueError(f"{qualname} reads {' or '.join(FORMATS)} expert weights, got {sorted(fmts)}")
    gate, up, down = (_parts(w[k], fmt) for k in ("gate_proj", "up_proj", "down_proj"))
    ok = all(t.stride(-1) == 1 for part in (gate, up, down) for t in part) \
        and all(a.stride() == b.stride() for a, b in zip(gate, up))
    if not ok:
        raise ValueError(f"{qualname} needs its weights and scales contiguous along their last dim, gate/up alike")
    return fmt, gate, up, down


def quantized_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: dict,
                      cfg: dict) -> torch.Tensor:
    """The `experts` contract on FP8 or NVFP4 expert weights, at one of the variant's tuning configs."""
    fmt, (wg, sg, sg2), (wu, su, su2), (wd, sd, sd2) = checked_weights(w)
    nvfp4 = fmt == "nvfp4"
    n, top_k = ids.shape
    ff, hidden = wg.shape[1], x.shape[1]
    x, ids, rw = x.contiguous(), ids.contiguous(), weights.contiguous().float()
    y = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    n_pairs = n * top_k
    if n_pairs == 0:
        return y
    launch = dict(num_stages=cfg["num_stages"], NVFP4=nvfp4, **pdl_launch(cfg.get("pdl")))

    # BLOCK_K counts inputs: a power of two of at least 16 covers whole NVFP4 blocks (hidden and ff are
    # multiples of 16 in that format)
    act = torch.empty(n_pairs, ff, dtype=x.dtype, device=x.device)
    bn, bk = cfg["BLOCK_N"], min(cfg["BLOCK_K"], triton.next_power_of_2(hidden))
    gate_up_quantized_kernel[(n_pairs, triton.cdiv(ff, bn))](
        x, ids, wg, wu, sg, su, sg2, su2, act, hidden, ff, wg.stride(0), wg.stride(1), sg.stride(0), sg.stride(1),
        TOP_K=top_k, BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg["num_warps"], **launch)
    bn, bk = cfg["DOWN_BLOCK_N"], min(cfg["DOWN_BLOCK_K"], triton.next_power_of_2(ff))
    down_quantized_kernel[(n, triton.cdiv(hidden, bn))](
        act, ids, rw, wd, sd, sd2, y, hidden, ff, wd.stride(0), wd.stride(1), sd.stride(0), sd.stride(1),
        TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), BLOCK_N=bn, BLOCK_K=bk,
        num_warps=cfg.get("DOWN_WARPS", cfg["num_warps"]), **launch)
    return y
