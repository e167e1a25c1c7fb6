"""What the FP8 weight-only GEMV variants (`qkvg_proj:triton_fp8`, `dense_mlp:triton_fp8`,
`attn_out:triton_fp8`) share: their tuning configs and the sizes they serve (up to `gemv_fp8.MAX_ROWS`
activation rows). Imports no triton: the variant modules import this when they register, the kernel on
their first call.
"""

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


def decode_supports(qualname: str):
    """The `supports` of an FP8 GEMV variant: a GPU that loads E4M3, a float dtype, at most MAX_ROWS
    activation rows."""
    def supports(wl):
        from workbench.variants.kernels.gemv_fp8 import MAX_ROWS  # kernels: imported on use

        if why := e4m3_unsupported(qualname):
            return why
        if wl.dtype not in ("bf16", "fp16", "fp32"):
            return f"{qualname} computes in bf16, fp16 or fp32, not {wl.dtype}"
        if wl.tokens > MAX_ROWS:
            return f"a decode GEMV: past {MAX_ROWS} rows each row tile re-reads the weights"
        return True
    return supports
