"""How close is batch-1 decode `attention` to a kernel that only reads its KV bytes?
Issue 5 asks full-attention decode at 32K tokens of context to run within 1.5x of its KV bytes floor
(the bytes at the copy bandwidth). This times, in one process on the GPU, with the workbench's timer
(`bench.time_call`: CUDA graphs of 16 calls back to back, inputs rotated past twice the L2):
- `attention:triton` and `attention:triton_prefetch` (its first key block loaded before the PDL wait)
  at every tuning config of their lists, with and without PDL (`--variants` to choose);
- a read-only Triton kernel over a flat buffer of exactly the point's floor bytes (a sum a program,
  no math to speak of) at several bytes a program and warps: without PDL, with PDL waiting before its
  loads (as attention:triton's decode kernel must: the previous kernel wrote its query), and with PDL
  loading before the wait (a bound: in a graph of back-to-back calls, one call's loads then overlap the
  last's); each also followed by a second, empty launch (the least a separate merge could cost);
- an empty kernel: one launch in a graph, no bytes.
The read kernels' time is what streaming those bytes costs in one or two launches of this size; the
decode's gap to it is what a better decode kernel could still win.

    python3 scripts/gpu_attention_read_floor.py [--out FILE] [--cases full-32768 sliding-4096]
        [--variants triton triton_prefetch] [--no-reads]
    python3 scripts/gpu_attention_read_floor.py --summarize FILE.json   # the fastest of each kind (CPU)
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from workbench import bench, registry  # noqa: E402
from workbench.points import Call, Workload, spec  # noqa: E402
from workbench.variants._triton_common import pdl_launch, pdl_release, pdl_wait  # noqa: E402

PRESET = "beam-501b-tp8"


@triton.jit
def _read(x_ptr, out_ptr, N, CHUNK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    """Program c sums elements [c * CHUNK, (c + 1) * CHUNK) of x[N], loaded in one tile (every load in
    flight at once: a loop of dependent loads waits on the memory once an iteration). Under PDL it waits
    for the previous kernel before its loads, as a decode kernel whose query the previous kernel wrote
    must; EARLY: after them (the bound for a kernel that reads its old KV before waiting)."""
    pdl_release(PDL)
    if not EARLY:
        pdl_wait(PDL)
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    total = tl.sum(tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32))
    if EARLY:
        pdl_wait(PDL)
    tl.store(out_ptr + tl.program_id(0), total)


@triton.jit
def _empty(out_ptr, PDL: tl.constexpr):
    pdl_release(PDL)
    pdl_wait(PDL)
    tl.store(out_ptr + tl.program_id(0), 0.0)


def read(x, out, chunk_bytes, warps, pdl=False, early=False):
    chunk = chunk_bytes // x.element_size()
    _read[(triton.cdiv(x.numel(), chunk),)](x, out, x.numel(), CHUNK=chunk, EARLY=early, num_warps=warps,
                                             **pdl_launch(pdl))


def empty(out, pdl=False):
    _empty[(1,)](out, num_warps=1, **pdl_launch(pdl))


def time_case(layer: str, context: int, ceilings: dict, names: list[str], reads: bool) -> dict:
    wl = Workload(PRESET, batch=1, context=context, layer=layer, dtype="bf16")
    floor_bytes = int(spec("attention").bytes(wl))
    case = {"layer": layer, "context": context, "batch": 1, "floor_bytes": floor_bytes,
            "floor_us": floor_bytes / ceilings["bandwidth_Bps"] * 1e6, "timings": {}}

    def record(label, t):
        case["timings"][label] = {k: t[k] for k in ("median_us", "spread", "graph", "graph_error")}
        print(f"[{layer} {context}] {label}: {t['median_us']:.2f} us (spread {t['spread']:.3f}, "
              f"floor x{t['median_us'] / case['floor_us']:.2f})", flush=True)

    for name in names:
        variant = registry.get("attention", name)
        for config in variant.tuning_configs():
            for pdl in (False, True):
                c = {**config, "pdl": pdl}
                record(f"attention:{name} {json.dumps(c, sort_keys=True)}",
                       bench.time_variant(variant, wl, device="cuda", config=c))
    if not reads:
        return case

    n = floor_bytes // 2
    out = torch.empty(triton.cdiv(n, 1024), device="cuda")  # a partial a program at >= 2 KB a program
    paths = {"empty kernel": lambda x: empty(out), "empty kernel, PDL": lambda x: empty(out, True)}
    pdl_modes = {"": (False, False), ", PDL": (True, False), ", PDL, loads before the wait": (True, True)}
    for chunk_kb, warps in ((8, 4), (16, 4), (32, 4), (32, 8), (64, 8)):
        for mode, (pdl, early) in pdl_modes.items():
            tag = f"read, {chunk_kb} KB a program, {warps} warps{mode}"
            a = (chunk_kb * 1024, warps, pdl, early)
            paths[tag] = lambda x, a=a: read(x, out, *a)
            paths[tag + ", then an empty launch"] = lambda x, a=a: (read(x, out, *a), empty(out, a[2]))
    for label, fn in paths.items():
        t = bench.time_call(fn, lambda i: Call((torch.randn(n, device="cuda", dtype=torch.bfloat16),)),
                            device="cuda", touched_bytes=floor_bytes)
        record(label, t.as_dict())
    return case


def _kind(label: str) -> str:
    """A timing's kind: the variant (with PDL or not), the empty kernel, or the read's launch form."""
    if label.startswith("attention:"):
        return label.split(" ")[0] + (", PDL" if '"pdl": true' in label else "")
    if label.startswith("read"):
        return "read" + ", PDL" * ("PDL" in label) + ", loads before the wait" * ("before the wait" in label) \
            + ", then an empty launch" * ("empty launch" in label)
    return label


def summarize(path: str) -> str:
    """A markdown table per case: the fastest timing of each kind, with its label and x of the floor."""
    with open(path) as fh:
        result = json.load(fh)
    lines = [f"`{result['command']}` ({result['environment'].get('gpu', '')}, copy bandwidth "
             f"{result['ceilings']['bandwidth_Bps'] / 1e12:.3f} TB/s)"]
    for case in result["cases"]:
        best = {}
        for label, t in case["timings"].items():
            kind = _kind(label)
            if kind not in best or t["median_us"] < best[kind][0]:
                best[kind] = (t["median_us"], label)
        lines += ["", f"{case['layer']} attention, batch 1, {case['context']} tokens of context: floor "
                  f"{case['floor_bytes']} bytes, {case['floor_us']:.3f} us", "",
                  "| kind | fastest us | x floor | which |", "| --- | ---: | ---: | --- |"]
        lines += [f"| {kind} | {us:.2f} | {us / case['floor_us']:.2f} | {label} |"
                  for kind, (us, label) in sorted(best.items())]
    return "\n".join(lines) + "\n"


def main():
    if sys.argv[1:2] == ["--summarize"]:
        print(summarize(sys.argv[2]), end="")
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--cases", nargs="+", default=["full-32768", "sliding-4096"], help="LAYER-CONTEXT")
    ap.add_argument("--variants", nargs="+", default=["triton", "triton_prefetch"], help="attention variants")
    ap.add_argument("--no-reads", action="store_true", help="time the variants only")
    args = ap.parse_args()
    ceilings = bench.measure_device_ceilings("cuda")
    result = {"command": "python3 scripts/gpu_attention_read_floor.py " + " ".join(sys.argv[1:]),
              "environment": bench.environment("cuda"), "preset": PRESET, "ceilings": ceilings, "cases": []}
    for case in args.cases:
        layer, context = case.split("-")
        result["cases"].append(time_case(layer, int(context), ceilings, args.variants, not args.no_reads))
        if args.out:  # after each case: a cut command keeps what it measured
            with open(args.out, "w") as fh:
                json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
