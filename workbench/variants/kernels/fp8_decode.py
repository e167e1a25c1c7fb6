"""What the FP8 weight-only GEMV variants (`*:triton_fp8`, `*:triton_fp8_rows` of `qkvg_proj`, `dense_mlp`
and `attn_out`) share: the tiled kernel's tuning configs, the sizes a variant serves and the weights its
kernel reads. Imports no triton: the variant modules import this when they register, the kernel on their
first call.
"""

from beam_model.quant.tensors import Fp8Weight

# BLOCK_N weight rows x BLOCK_K inputs a step at one row (the K tile shrinks as the rows grow); the first
# is the default. One config drives every launch of a variant.
CONFIGS = [
    dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=1),
    dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=1),
    dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=2),
]


def e4m3_unsupported(qualname: str) -> str | None:
    """Why this GPU cannot run a kernel that loads E4M3 values (Triton converts them on sm_89 and later:
    Ada, Hopper, Blackwell), or None; None on the CPU, where the interpreter converts them."""
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        return f"{qualname} loads E4M3 values, which Triton converts on sm_89 or later, not sm_{major}{minor}"
    return None


MAX_ROWS = 16  # activation rows the tiled kernel serves at most; past them each row tile re-reads the weights


def decode_supports(qualname: str, rows: int = MAX_ROWS,
                    past: str = "a decode GEMV: past them each row tile re-reads the weights"):
    """The `supports` of an FP8 GEMV variant: a GPU that loads E4M3, a float dtype, at most `rows` activation
    rows (`past` says why no more)."""
    def supports(wl):
        if why := e4m3_unsupported(qualname):
            return why
        if wl.dtype not in ("bf16", "fp16", "fp32"):
            return f"{qualname} computes in bf16, fp16 or fp32, not {wl.dtype}"
        if wl.tokens > rows:
            return f"{qualname} serves up to {rows} rows ({past})"
        return True
    return supports


def fp8_weights(w, up, kernel: str) -> tuple[Fp8Weight, Fp8Weight]:
    """(w, up) as an FP8 GEMV reads them: Fp8Weights [out, in] with rows contiguous and one scale a row, gate
    and up (SwiGLU) with one shape and one set of strides; without `up`, w twice (the kernel's second
    pointers then go unread)."""
    w = _fp8_weight(w, kernel, "the weight")
    if up is None:
        return w, w
    up = _fp8_weight(up, kernel, "up")
    if up.shape != w.shape or up.weight.stride() != w.weight.stride() or up.scale.stride() != w.scale.stride():
        raise ValueError(f"{kernel} reads gate and up with one shape and one set of strides")
    return w, up


def _fp8_weight(w, kernel: str, name: str) -> Fp8Weight:
    if not isinstance(w, Fp8Weight):
        raise ValueError(f"{kernel} reads fp8 weights, got {getattr(w, 'format', 'bf16')} for {name}")
    if w.weight.dim() != 2 or w.weight.stride(-1) != 1 or w.scale.shape != (w.weight.shape[0], 1):
        raise ValueError(f"{kernel} needs {name} as [out, in] with rows contiguous and an [out, 1] scale")
    return w
