"""How a point's reference, in the model dtype, fares in the op gate's worst-element check against
its high-precision self, under the output-wide scale (|ref| + output RMS, the check before session 31)
and the row scale (|ref| + the larger of its row's and the output's RMS). A reference that fails a
check is a fault of the check. Then the op gate of the reference as it stands.

Usage: python scripts/gate_scale_probe.py [--point attention_out] [--preset beam-501b-tp8]
       [--batch 1] [--tokens 8192] [--layer full] [--dtype bf16] [--seed 0] [--out DIR]
"""

import argparse
import json
import os
import time

import torch

from workbench import gates
from workbench.bench import environment
from workbench.points import Workload, spec
from workbench.registry import REFERENCE, get


def ratios(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """The old check's worst element (written out here: the gate no longer has it) and the gate's own."""
    out, ref = out.double(), ref.double()
    output_rms = ref.square().mean().sqrt()
    old = (out - ref).abs() / (ref.abs() + output_rms)
    new, new_where = gates._worst_element(out, ref)
    return {"output_scale": old.max().item(),
            "output_scale_where": [int(i) for i in torch.unravel_index(old.argmax(), old.shape)],
            "row_scale": new, "row_scale_where": list(new_where),
            "largest_row_rms_over_output_rms": (ref.square().mean(-1).sqrt().max() / output_rms).item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--point", default="attention_out")
    ap.add_argument("--preset", default="beam-501b-tp8")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layer", default="full")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args()
    wl = Workload(preset=a.preset, batch=a.batch, tokens_per_seq=a.tokens, context=a.tokens, layer=a.layer,
                  dtype=a.dtype)
    device = torch.device("cpu")
    point = spec(a.point)
    call = point.make_inputs(wl, device, a.seed)
    t0 = time.perf_counter()
    with torch.no_grad():  # as the op gate calls a candidate: the reference variant on a copy
        c = gates._copy(call)
        low = gates._outputs(get(a.point, REFERENCE).fn(*c.args, **c.kwargs))
    high, _ = gates._reference(a.point, call, gates._hp_dtype(device, a.dtype), device)
    limit = gates.ELEMENT_FACTOR * point.tolerance[a.dtype]
    outputs = [dict(output=i, **ratios(o, h)) for i, (o, h) in enumerate(zip(low, high))
               if isinstance(o, torch.Tensor) and o.is_floating_point()]
    report = gates.op_gate(get(a.point, REFERENCE), [wl], device=device, seeds=(a.seed,))
    result = {"command": "python scripts/gate_scale_probe.py " + " ".join(
                  f"--{k} {v}" for k, v in vars(a).items() if v is not None and k != "out"),
              "workload": wl.label(), "seed": a.seed, "element_limit": limit, "outputs": outputs,
              "op_gate_of_the_reference": [
                  {"check": c.name, "passed": c.passed, "error": c.error, "threshold": c.threshold, "detail": c.detail}
                  for c in report.checks if c.error is not None or not c.passed],
              "seconds": round(time.perf_counter() - t0, 1), "environment": environment(device)}
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"{a.point}-{wl.label().replace(' ', '-')}-seed{a.seed}.json"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
