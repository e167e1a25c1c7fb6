"""How far quantizing activations per token to E4M3 moves each FP8 point's output: the measurement behind
`PointSpec.activation_tolerance` (docs/decisions.md #42).

Each point's W8A8 variant (`*:fp8_scaled_mm`, `experts:triton_fp8_grouped`) through the op gate (tolerance
lifted, so every case reports its error),
on FP8 weights, on the CPU: random inputs at beam-tiny's and a TP8 rank's shapes (decode and a prefill, three seeds),
and calls captured from the trained beam-mini, quantized to FP8, on held-out text. Writes OUT/errors.json:
per point, the gate's errors per case (the norm-wise relative error, and the worst element's, which the
gate holds to ELEMENT_FACTOR x the tolerance), and the largest of each.

    python scripts/fp8_activation_error.py runs/fp8-activation-error-cpu
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")  # on the CPU: the quantization kernel interpreted, before triton loads

import torch  # noqa: E402

from beam_model.model import BeamForCausalLM  # noqa: E402
from beam_model.quantized_checkpoint import quantize_checkpoint  # noqa: E402
from beam_model.tokenizer import load_tokenizer  # noqa: E402
from workbench import gates  # noqa: E402
from workbench.commands.check import TEXT_WINDOWS  # noqa: E402
from workbench.commands.common import embedded_model  # noqa: E402
from workbench.points import Workload, spec  # noqa: E402
from workbench.registry import get  # noqa: E402
from workbench.training.data import held_out_batch  # noqa: E402

VARIANTS = {"qkvg_proj": "fp8_scaled_mm", "attn_out": "fp8_scaled_mm", "dense_mlp": "fp8_scaled_mm",
            "experts": "triton_fp8_grouped"}
POINTS = tuple(VARIANTS)


def workloads(point: str) -> list[tuple[Workload, tuple[int, ...]]]:
    """(workload, seeds): decode of 1 and 3 sequences and a 2 x 32 prefill at both presets, three seeds; the
    experts at the TP8 rank only at one decode and one seed (interpreted, each call over its 256 experts takes
    minutes)."""
    kinds = ["sliding"] if point != "qkvg_proj" else ["sliding", "full"]
    sizes = {"beam-tiny": ((1, 1), (3, 1), (2, 32)),
             "beam-501b-tp8": ((1, 1),) if point == "experts" else ((1, 1), (3, 1), (2, 32))}
    return [(Workload(preset, layer=kind, weights="fp8", context=64, batch=b, tokens_per_seq=t),
             (0,) if point == "experts" and preset != "beam-tiny" else (0, 1, 2))
            for preset, shapes in sizes.items() for b, t in shapes for kind in kinds]


def captured_on_text() -> dict:
    folder = embedded_model()
    with tempfile.TemporaryDirectory() as tmp:
        quantize_checkpoint(folder, tmp, "fp8")
        model = BeamForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16)
        ids = held_out_batch(load_tokenizer(folder), *TEXT_WINDOWS)
        return gates.capture_calls(model, ids, POINTS)


def main(out: str) -> None:
    captured = captured_on_text()
    result = {"command": "python scripts/fp8_activation_error.py " + out, "torch": torch.__version__,
              "element_factor": gates.ELEMENT_FACTOR, "points": {}}
    for point in POINTS:
        s = spec(point)
        saved = dict(s.activation_tolerance)
        s.activation_tolerance["fp8"] = 1.0  # lifted: every case reports its error
        try:
            checks = [c for wl, seeds in workloads(point)
                      for c in gates.op_gate(get(point, VARIANTS[point]), [wl], seeds=seeds).checks]
            checks += gates.op_gate(get(point, VARIANTS[point]), [], captured=captured[point]).checks
        finally:
            s.activation_tolerance.clear()
            s.activation_tolerance.update(saved)
        cases: dict[str, dict] = {}  # case -> the largest error of its outputs, norm-wise and worst element
        for c in checks:
            if c.name == "accuracy" and c.error is not None:
                kind = "worst_element" if "worst element" in c.detail else "norm"
                errors = cases.setdefault(c.case, {"norm": 0.0, "worst_element": 0.0})
                errors[kind] = max(errors[kind], c.error)
        result["points"][point] = {
            "cases": cases,
            "max": {kind: max(v[kind] for v in cases.values()) for kind in ("norm", "worst_element")},
            "failed_other_checks": [f"{c.name} {c.case}: {c.detail}" for c in checks
                                    if not c.passed and c.name != "accuracy"],
        }
        print(point, result["points"][point]["max"], flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "errors.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
