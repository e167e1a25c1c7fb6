"""Quantized weights: the FP8 and NVFP4 formats (`formats`), which modules a ModelOpt
`quantization_config` quantizes (`scheme`), and checkpoints in them on disk (`checkpoint`)."""
