"""Registers and spills (STACK > 0) of `qk_prep:triton`'s kernel for sm_90 at beam-501b-tp8, per
num_warps and PDL, compiled on the CPU (`workbench.sm90`), for this tree and, with --rev, the kernel
as it was at a git revision. Why: the PDL change reads both norm weights before the grid-dependency
wait, so they stay live across the Q norm; at 1-2 warps that costs registers and spills, and the
prefill search timed qk_prep's 1- and 2-warp configs 2.8x and 4.2x slower than before
(runs/optimize-prefill-8x2k-beam-501b-tp8/README.md). The GPU host's Triton may allocate differently.

    python3 scripts/sm90_qk_prep.py [--rev 55292e64]
"""

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # interpreted kernels do not compile
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from beam_model.config import BeamConfig  # noqa: E402
from workbench import registry  # noqa: E402
from workbench.sm90 import compile_sm90, resource_usage  # noqa: E402
from workbench.variants import qk_prep  # noqa: E402

POINTERS = ("q_ptr", "k_ptr", "v_ptr", "q_w_ptr", "k_w_ptr", "cache_ptr", "q_out_ptr")
INTS = ("q_stride", "k_stride", "v_stride", "n_heads", "n_kv_heads", "page_size", "c_page", "c_kv", "c_slot", "c_head")
FLOATS = ("eps", "theta", "ssmax_base", "ssmax_exponent")


def _at_revision(rev: str):
    """qk_prep.py as it was at `rev`, imported without registering its variants again."""
    source = subprocess.run(["git", "show", f"{rev}:workbench/variants/qk_prep.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "qk_prep_at_rev.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("qk_prep_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    register, registry.register = registry.register, lambda *a, **k: (lambda fn: fn)
    try:
        spec.loader.exec_module(module)
    finally:
        registry.register = register
    return module


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", help="also compile the kernel as it was at this git revision")
    args = ap.parse_args()
    c = BeamConfig.from_preset("beam-501b-tp8")
    p2 = lambda x: 1 << (x - 1).bit_length()  # noqa: E731
    sig = {**{n: "*bf16" for n in POINTERS}, "slot_ptr": "*i64", "pos_ptr": "*i64",
           **{n: "i32" for n in INTS}, **{n: "fp32" for n in FLOATS}}
    kernels = {"this tree": qk_prep._qk_prep_kernel}
    if args.rev:
        kernels[args.rev] = _at_revision(args.rev)._qk_prep_kernel
    print(f"qk_prep:triton at beam-501b-tp8 (head_dim {c.head_dim}, {c.num_attention_heads} heads, "
          f"{c.num_key_value_heads} kv heads), sm_90")
    for layer, rope in (("sliding (RoPE)", True), ("full (SSMax)", False)):
        for warps in (1, 2, 4, 8):
            for name, kernel in kernels.items():
                for pdl in ((False, True) if "PDL" in kernel.arg_names else (False,)):
                    ce = dict(HD=c.head_dim, HALF=p2(c.head_dim // 2), HEADS=p2(c.num_attention_heads),
                              KV_HEADS=p2(c.num_key_value_heads), ROPE=rope, SSMAX=not rope,
                              **({"PDL": True} if pdl else {}))
                    use = resource_usage(compile_sm90(kernel, sig, ce, num_warps=warps))
                    print(f"  {layer:15s} num_warps={warps} {name:10s} pdl={str(pdl):5s} "
                          f"REG {use['REG']:3d}  STACK {use['STACK']:3d}")


if __name__ == "__main__":
    main()
