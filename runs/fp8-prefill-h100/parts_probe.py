"""The parts of an FP8 W8A8 GEMM at a prompt's size on the GPU (dense_mlp's gate shape at a TP8 rank, 16K
tokens): the PyTorch per-token quantization eager and compiled, torch._scaled_mm, the reference's dequantize
and its BF16 GEMM. Writes the JSON to the path given.

    PYTHONPATH=. python3 runs/fp8-prefill-h100/parts_probe.py fp8-parts.json
"""
import torch, json, sys
from beam_model.quant.formats import quantize_fp8
from beam_model.config import BeamConfig
from workbench.variants.kernels.fp8_scaled_mm import fp8_gemm
from beam_model.quant.tensors import quantize
c = BeamConfig.from_preset("beam-501b-tp8")
x = torch.randn(16384, c.hidden_size, device="cuda", dtype=torch.bfloat16)
w = quantize(torch.randn(c.intermediate_size, c.hidden_size, device="cuda", dtype=torch.bfloat16) * 0.02, "fp8")
wb = w.dequantize(torch.bfloat16)
def t(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n * 1e3
codes, scale = quantize_fp8(x)
qc = torch.compile(quantize_fp8)
r = {"shape": [16384, c.hidden_size, c.intermediate_size],
     "quantize_eager_us": t(lambda: quantize_fp8(x)), "quantize_compiled_us": t(lambda: qc(x)),
     "scaled_mm_us": t(lambda: fp8_gemm(codes, scale, w, torch.bfloat16)),
     "dequantize_us": t(lambda: w.dequantize(torch.bfloat16)),
     "bf16_mm_us": t(lambda: torch.nn.functional.linear(x, wb))}
print(json.dumps(r)); json.dump(r, open(sys.argv[1], "w"), indent=1)
