"""Gate fusion-point variants against their references (op gate); exits non-zero if any fails.

`workbench check` gates every variant of every point that can run here; `workbench check route`
one point's; `workbench check route:triton` (or a bare variant name, on every point) one variant.
Variants of a point that all-reduces (boundary) also pass the rank gate on `--ranks` processes
(workbench/rank_gate.py). A variant whose backend is missing, that needs CUDA on a CPU run, or whose
`supports` declines a workload is listed as skipped with the reason, never silently passed; so is a
variant quarantined on this device (workbench/quarantine.py) unless named as POINT:VARIANT. CI runs
`--device cpu` on beam-tiny; a GPU run takes the real shapes, e.g. `--device cuda --preset
beam-501b-tp8 --batch 1 8 64`.
This command only reports: it never edits a lock file or the registry.
"""

from __future__ import annotations

import time

from workbench.agent import worker
from workbench.commands.common import add_weights_argument, add_worker_arguments, print_json, run_in_worker
from workbench.dtypes import DTYPES, dtype_of


def add_arguments(p) -> None:
    p.add_argument("target", nargs="?", metavar="POINT|VARIANT",
                   help="a fusion point, POINT:VARIANT, or a variant name (default: everything)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--backend", nargs="+", metavar="B",
                   help="only variants of these backends (torch, torch_compile, triton, flashinfer, cute)")
    p.add_argument("--preset", default="beam-tiny", help="shapes of this preset (default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    add_weights_argument(p, what="the points' projections", default="bf16")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 3], metavar="B",
                   help="decode batch sizes (default: 1 3); the first runs at the long context")
    p.add_argument("--context", type=int, nargs=2, default=[1000, 150], metavar=("LONG", "SHORT"),
                   help="KV length of the first decode workload and of the others (default: 1000 150)")
    p.add_argument("--prefill", type=int, nargs=3, default=[2, 24, 100], metavar=("B", "T", "CTX"),
                   help="prefill workload: B sequences of T new tokens, CTX tokens of KV after the step "
                        "(default: 2 24 100; 0 0 0: none)")
    p.add_argument("--seeds", type=int, default=3, help="fresh seeds per workload (default: 3)")
    p.add_argument("--ranks", type=int, default=2, metavar="N",
                   help="also gate the variants of points that all-reduce (boundary) on N tensor-parallel "
                        "ranks, one process each (default: %(default)s; 1: not at all)")
    p.add_argument("--no-capture", action="store_true",
                   help="skip activations captured from a model forward (default: captured on presets < 5B params; "
                        "from the trained model on held-out text where it has the preset's config, e.g. beam-mini)")
    p.add_argument("--dir", action="append", metavar="DIR",
                   help="plugin directory of variant modules (repeatable; also $BEAM_WORKBENCH_PLUGINS): "
                        "loaded and run in an isolated worker process")
    add_worker_arguments(p, what="runs plugin variants (--dir)", timeout_s=worker.DEFAULT_TIMEOUT_S,
                         mem_bytes=worker.DEFAULT_MEM_BYTES)
    p.add_argument("--json", action="store_true", help="machine-readable output")


def workloads(args) -> list:
    """The default set: long-context decode, short decode at the other batch sizes, one prefill chunk."""
    from workbench.points import Workload

    base = Workload(preset=args.preset, dtype=args.dtype, weights=args.weights)
    long_ctx, short_ctx = args.context
    out = [base.with_(batch=b, context=long_ctx if i == 0 else short_ctx) for i, b in enumerate(args.batch)]
    b, t, ctx = args.prefill
    if b and t:
        out.append(base.with_(batch=b, tokens_per_seq=t, context=ctx))
    return out


def targets(target: str | None) -> list:
    from workbench.registry import POINTS, get, variants

    if target is None:
        return [v for p in POINTS for v in variants(p).values()]
    if target in POINTS:
        return list(variants(target).values())
    if ":" in target:
        return [get(*target.split(":", 1))]
    found = [v for p in POINTS for v in variants(p).values() if v.name == target]
    if not found:
        raise KeyError(f"{target!r} is neither a fusion point ({', '.join(POINTS)}) nor a registered variant")
    return found


# Held-out text the trained model's calls are captured on: windows long enough for its attention to peak
# and its sub-layer outputs to reach the rows a short prompt does not (FP16 sums of squares past 65504).
TEXT_WINDOWS = (2, 256)


def _capture(args, points):
    """Calls captured from a model forward (presets under 5B parameters): the embedded trained model on
    held-out text where it has the preset's config and its weights are BF16 (peaked attention, skewed
    routing, sub-layer outputs far larger than a random model's), else the preset's random weights on
    random ids."""
    import torch

    from beam_model.config import BeamConfig
    from beam_model.model import BeamForCausalLM
    from workbench.commands.common import embedded_model
    from workbench.gates import capture_calls

    config = BeamConfig.from_preset(args.preset)
    if args.no_capture or config.num_parameters >= 5e9:
        return {}
    folder = embedded_model()
    if folder and args.weights == "bf16" and BeamConfig.from_pretrained(folder).config_hash() == config.config_hash():
        from beam_model.tokenizer import load_tokenizer
        from workbench.training.data import held_out_batch

        model = BeamForCausalLM.from_pretrained(folder, dtype=dtype_of(args.dtype), device=args.device)
        ids, source = held_out_batch(load_tokenizer(folder), *TEXT_WINDOWS), "text"
    else:
        model = BeamForCausalLM.from_preset(args.preset, dtype=dtype_of(args.dtype), device=args.device,
                                            weights=args.weights)
        b, t = args.prefill[:2] if all(args.prefill[:2]) else (2, 24)  # the prefill's shape: fewer compiles
        ids = torch.randint(0, model.config.vocab_size, (b, t), generator=torch.Generator().manual_seed(0))
        source = "random"
    captured = capture_calls(model, ids.to(args.device), points)
    for calls in captured.values():
        for call in calls:
            call.label = f"{source} {call.label or call.layer}"
    return captured


def gate_all(args) -> list[dict]:
    from workbench.gates import op_gate
    from workbench.points import LAYER_DEPENDENT
    from workbench.quarantine import quarantined
    from workbench.rank_gate import all_reduces, rank_gate, registered

    chosen = [v for v in targets(args.target) if not args.backend or v.backend in args.backend]
    if not chosen:
        raise KeyError(f"no variant of {args.target or 'any point'} has backend {' or '.join(args.backend)}")
    captured = _capture(args, sorted({v.point for v in chosen}))
    explicit = args.target is not None and ":" in args.target  # a named variant runs even if quarantined
    rows = []
    for v in chosen:
        row = {"point": v.point, "variant": v.name, "backend": v.backend}
        why = v.unsupported(device=args.device) or (None if explicit else quarantined(v.point, v.name, args.device))
        if why:
            rows.append({**row, "status": "skip", "reason": why})
            continue
        layers = ("sliding", "full") if v.point in LAYER_DEPENDENT else ("sliding",)
        wanted = [w.with_(layer=k) for w in workloads(args) for k in layers]
        calls = captured.get(v.point, [])
        try:
            declined = {w.label(): v.unsupported(w) for w in wanted + [c.workload for c in calls]}
        except Exception as e:
            rows.append({**row, "status": "fail", "reason": f"supports() raised {type(e).__name__}: {e}"})
            continue
        declined = {k: r for k, r in declined.items() if r}
        wanted = [w for w in wanted if w.label() not in declined]
        calls = [c for c in calls if c.workload.label() not in declined]
        if not wanted and not calls:
            rows.append({**row, "status": "skip", "reason": "; ".join(sorted(set(declined.values())))})
            continue
        t0 = time.perf_counter()
        report = op_gate(v, wanted, device=args.device, seeds=tuple(range(args.seeds)), captured=calls)
        if args.ranks > 1 and all_reduces(v.point) and wanted:
            # the first workload and the prefill chunk: one spawn of the ranks per variant
            ranked = rank_gate(registered(v.point, v.name), [wanted[0]] + wanted[-1:] * (len(wanted) > 1),
                               world=args.ranks, device=args.device, seeds=tuple(range(min(2, args.seeds))))
            report.checks += ranked.checks
        rows.append({**row, "status": "pass" if report.passed else "fail", "declined": declined, "report": report,
                     "seconds": round(time.perf_counter() - t0, 2)})
    return rows


def run(args) -> int:
    from workbench.agent import plugins

    if plugins.plugin_dirs(args.dir) and not worker.inside_worker():
        return run_in_worker("check", args)  # plugin code runs only in a worker process
    t0 = time.perf_counter()
    rows = gate_all(args)
    failed = [r for r in rows if r["status"] == "fail"]
    if args.json:
        print_json({"preset": args.preset, "dtype": args.dtype, "device": args.device, "passed": not failed,
                    "seconds": round(time.perf_counter() - t0, 1),
                    "results": [{**r, "report": r["report"].to_dict()} if "report" in r else r for r in rows]})
        return 1 if failed else 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"op gate: {args.preset} {args.dtype} on {args.device}")
    for col in ("point", "variant", "backend", "status", "worst error / threshold", "failing check"):
        table.add_column(col)
    style = {"pass": "green", "fail": "bold red", "skip": "dim"}
    for r in rows:
        rep = r.get("report")
        worst = rep.worst() if rep else None
        first = rep.failures[0] if rep and rep.failures else None
        note = (f"{first.name} [{first.case}] {first.detail}" if first
                else r.get("reason", "") or "; ".join(f"declined {k}: {v}" for k, v in r.get("declined", {}).items()))
        table.add_row(r["point"], r["variant"], r["backend"], f"[{style[r['status']]}]{r['status']}[/]",
                      f"{worst.error:.3g} / {worst.threshold:.3g} ({worst.name})" if worst else "", note)
    console = Console()
    if not console.is_terminal:
        console.width = 200  # CI logs: one line per row
    console.print(table)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "skip")}
    console.print(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped "
                  f"in {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0
