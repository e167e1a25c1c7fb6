"""What the CuTe DSL variants share without importing cutlass (the point modules import this)."""

VEC = 8  # values of a 16-bit dtype in one 16-byte access


def vector_rows_supported(workload) -> bool | str:
    """Rows the kernels read in whole 16-byte vectors: bf16/fp16 and a hidden size that is a multiple
    of VEC; True, or the reason they cannot."""
    hidden = workload.config.hidden_size
    if workload.dtype not in ("bf16", "fp16"):
        return f"dtype {workload.dtype} not handled (bf16, fp16: {VEC} values per 16-byte access)"
    if hidden % VEC:
        return f"hidden {hidden} is not a multiple of {VEC} (whole 16-byte vectors per row)"
    return True
