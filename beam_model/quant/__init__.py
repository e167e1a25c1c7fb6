"""Quantized weights: the FP8 and NVFP4 formats (`formats`), which modules a ModelOpt
`quantization_config` quantizes (`scheme`), a quantized projection as the points read it (`tensors`) and
as the model stores it (`layout`). Definitions only: checkpoints in these formats are written by
`beam_model.quantized_checkpoint` and read by `beam_model.weights`."""
