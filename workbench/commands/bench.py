"""Time a fusion point's variants at one workload against its reference and the roofline floor.

Prints a table (median, spread, % of the roofline floor, speed-up vs the reference, all from this
one run) or, with --json, the bench.json document; --out DIR also writes bench.json and report.md
there. Never edits variants or lock files.
"""

from __future__ import annotations

import json
import shlex

from workbench.agent import worker
from workbench.commands.common import (
    add_weights_argument,
    add_worker_arguments,
    print_json,
    resolve_device,
    run_in_worker,
    write_and_print,
)
from workbench.dtypes import DTYPES


def add_arguments(p) -> None:
    p.add_argument("point", metavar="POINT", help="fusion point, e.g. boundary, experts, attention")
    p.add_argument("--variants", nargs="+", metavar="NAME", help="variants to time (default: all registered; "
                   "the reference is always timed)")
    p.add_argument("--preset", "--shape-preset", dest="preset", default="beam-501b-tp8",
                   help="model preset whose shapes to use (default: %(default)s)")
    p.add_argument("--batch", type=int, default=1, help="sequences in the step (default: %(default)s)")
    p.add_argument("--context", type=int, default=4096, help="KV length per sequence (default: %(default)s)")
    p.add_argument("--prefill", type=int, metavar="T", help="prefill T tokens per sequence (default: decode)")
    p.add_argument("--layer", choices=("sliding", "full"), default="sliding",
                   help="attention kind for attention / qk_prep (default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="model dtype (default: %(default)s)")
    add_weights_argument(p, what="the point's projections", default="bf16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--graph", action="store_true", default=None,
                   help="replay CUDA graphs of the call (default on CUDA)")
    p.add_argument("--no-graph", dest="graph", action="store_false", help="time eager calls")
    p.add_argument("--seed", type=int, default=0, help="seed of the first input copy (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=10, help="warm-up calls (default: %(default)s)")
    p.add_argument("--min-reps", type=int, default=50, help="(default: %(default)s)")
    p.add_argument("--max-reps", type=int, default=2000, help="(default: %(default)s)")
    p.add_argument("--target-spread", type=float, default=0.05,
                   help="stop once (p90-p10)/median is below this (default: %(default)s)")
    p.add_argument("--max-seconds", type=float, default=2.0,
                   help="timing budget per variant, compilation excluded (default: %(default)s)")
    tune = p.add_mutually_exclusive_group()
    tune.add_argument("--configs", action="store_const", const="all", dest="configs",
                      help="time the variants at every registered tuning config, a row each")
    tune.add_argument("--config", action="append", metavar="JSON", dest="config_json",
                      help="time the variants at this tuning config (repeatable), e.g. "
                           "'{\"path\": \"gemv\", \"BLOCK_N\": 4, ...}': a tuner's own, no source edit")
    p.add_argument("--gate", action="store_true",
                   help="op-gate each variant and config at this shape first; one that fails is not timed")
    p.add_argument("--kernels", action="store_true",
                   help="also list the kernels one call of each variant launches, by device time (torch.profiler)")
    p.add_argument("--out", metavar="DIR", help="write bench.json and report.md to DIR (e.g. runs/NAME)")
    p.add_argument("--dir", action="append", metavar="DIR",
                   help="plugin directory of variant modules (repeatable; also $BEAM_WORKBENCH_PLUGINS): "
                        "loaded and run in an isolated worker process")
    add_worker_arguments(p, what="runs plugin variants (--dir)", timeout_s=worker.DEFAULT_TIMEOUT_S,
                         mem_bytes=worker.DEFAULT_MEM_BYTES)
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="time a point that all-reduces (boundary) on N tensor-parallel ranks at once, each its own "
                        "partial sum (NCCL with a GPU each, graphed; else gloo): per-rank medians, the slowest counts "
                        "(bench-tp.json with --out); --min-reps timed blocks of calls a rank")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def command_line(args, device, graph: bool) -> str:
    """The run's exact command with every default spelled out, so the result can be reproduced."""
    parts = ["workbench", "bench", args.point]
    if args.variants:
        parts += ["--variants", *args.variants]
    for d in getattr(args, "dir", None) or []:
        parts += ["--dir", d]
    parts += ["--preset", args.preset, "--batch", str(args.batch), "--context", str(args.context)]
    if args.prefill:
        parts += ["--prefill", str(args.prefill)]
    parts += ["--layer", args.layer, "--dtype", args.dtype, "--weights", args.weights,
              "--device", str(device), "--graph" if graph else "--no-graph", "--seed", str(args.seed),
              "--warmup", str(args.warmup),
              "--min-reps", str(args.min_reps), "--max-reps", str(args.max_reps),
              "--target-spread", str(args.target_spread), "--max-seconds", str(args.max_seconds)]
    if args.configs:
        parts.append("--configs")
    for c in args.config_json or []:
        parts += ["--config", c]
    if args.gate:
        parts.append("--gate")
    if args.kernels:
        parts.append("--kernels")
    if args.out:
        parts += ["--out", args.out]
    return shlex.join(parts + (["--json"] if args.json else []))


def _parse_configs(texts: list[str] | None) -> list[dict] | None:
    if not texts:
        return None
    configs = []
    for text in texts:
        try:
            config = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--config {text!r} is not JSON: {e}") from None
        if not isinstance(config, dict) or not config:
            raise ValueError(f"--config {text!r} must be a non-empty JSON object")
        configs.append(config)
    return configs


def _label(row) -> str:
    from workbench.bench_report import config_text

    return row["variant"] + (f" {config_text(row['config'])}" if row.get("config") else "")


def _print_table(rows, title) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("variant", "backend", "median us", "spread", "% floor", "vs ref", "first call ms", "note"):
        left = col in ("variant", "backend", "note")
        table.add_column(col, justify="left" if left else "right", no_wrap=col not in ("note", "variant"),
                         min_width=12 if col == "note" else None, overflow="fold" if col == "variant" else "ellipsis")
    for r in rows:
        if r["error"]:
            table.add_row(_label(r), r["backend"], "", "", "", "", "", f"[red]{r['error']}[/]")
            continue
        note = f"graph fallback: {r['graph_error']}" if r["graph_error"] else ("graph" if r["graph"] else "eager")
        table.add_row(_label(r), r["backend"], f"{r['median_us']:.2f}", f"{r['spread']:.1%}",
                      f"{r['pct_of_floor']:.1f}" if r["pct_of_floor"] is not None else "",
                      f"{r['speedup_vs_reference']:.2f}x" if r["speedup_vs_reference"] else "",
                      f"{r['first_call_ms']:.1f}" if r.get("first_call_ms") is not None else "", note)
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 140)  # logs and pipes: keep a row on one line
    console.print(table)


def _print_kernels(rows) -> None:
    from rich.console import Console
    from rich.table import Table

    from workbench.bench_report import top_kernels

    console = Console()
    for r in rows:
        if r.get("kernels_error"):
            console.print(f"{_label(r)}: kernels not listed: {r['kernels_error']}")
        if not r.get("kernels"):
            continue
        table = Table(title=f"{_label(r)}: kernels per call")
        for col in ("kernel", "launches", "us"):
            table.add_column(col, justify="left" if col == "kernel" else "right", overflow="fold")
        for cells in top_kernels(r["kernels"]):
            table.add_row(*cells)
        console.print(table)


def run(args) -> int:
    from workbench import bench
    from workbench.agent import plugins
    from workbench.bench_report import write_results
    from workbench.points import Workload
    from workbench.provenance import environment

    if plugins.plugin_dirs(args.dir) and not worker.inside_worker():
        return run_in_worker("bench", args)  # plugin code runs only in a worker process

    device = resolve_device(args.device)
    graph = device.type == "cuda" if args.graph is None else args.graph
    if graph and device.type != "cuda":
        raise ValueError("--graph needs a CUDA device")
    tokens = args.prefill or 1
    if args.batch < 1 or tokens < 1 or args.context < tokens:
        raise ValueError("need --batch >= 1, --prefill >= 1 and --context >= the prefill tokens")
    workload = Workload(preset=args.preset, batch=args.batch, tokens_per_seq=tokens, context=args.context,
                        layer=args.layer, dtype=args.dtype, weights=args.weights)
    workload.config  # an unknown preset fails here, before any timing
    if args.tp is not None:
        return _across_ranks(args, workload, device)
    timing = dict(warmup=args.warmup, min_reps=args.min_reps, max_reps=args.max_reps,
                  target_spread=args.target_spread, max_seconds=args.max_seconds, use_graph=graph)
    command = command_line(args, device, graph)
    configs = args.configs or _parse_configs(args.config_json)
    if args.config_json and not args.variants:
        raise ValueError("--config applies to the variants named with --variants")
    timing.update(configs=configs, gate=args.gate, kernels=args.kernels)

    if args.json:
        rows = bench.bench_point(args.point, args.variants, workload, device=device, seed=args.seed, **timing)
    else:
        from rich.progress import Progress, SpinnerColumn, TimeElapsedColumn

        with Progress(SpinnerColumn(), *Progress.get_default_columns(), TimeElapsedColumn(), transient=True) as bar:
            task = bar.add_task(f"{args.point}: ceilings", total=None)

            def progress(name, i, n):
                bar.update(task, total=n, completed=i, description=f"{args.point}: timing {name}")

            rows = bench.bench_point(args.point, args.variants, workload, device=device, seed=args.seed,
                                     on_progress=progress, **timing)
    env = environment(device)
    if args.out:
        write_results(rows, args.out, command, env)
    if args.json:
        print_json({"command": command, "environment": env, "rows": rows})
    else:
        floor = rows[0]["floor_us"]
        _print_table(rows, f"{args.point}  {workload.label()}  on {env['gpu'] or device}"
                           + (f"  (floor {floor:.2f} us)" if floor else ""))
        if args.kernels:
            _print_kernels(rows)
        if args.out:
            print(f"wrote {args.out}/bench.json and {args.out}/report.md")
    return 0 if rows[0]["error"] is None else 1


def _across_ranks(args, workload, device) -> int:
    """`--tp N`: the point on N ranks at once (`workbench.tp_bench`)."""
    from workbench.tp_bench import bench_across_ranks

    if args.configs or args.config_json or args.gate or args.kernels:
        raise ValueError("--tp times each variant at its default config: no --configs, --config, --gate or --kernels")
    result = bench_across_ranks(args.point, args.variants, workload, args.tp, device_type=device.type,
                                reps=args.min_reps, seed=args.seed)
    if write_and_print(args, "bench-tp.json", result):
        return 0 if result["rows"][0]["error"] is None else 1
    print(f"{args.point}  {result['shape']}  on {args.tp} ranks ({result['backend']}"
          f"{', graphed' if result['rows'][0]['graph'] else ''}): us per call")
    for row in result["rows"]:
        if row["error"]:
            print(f"  {row['variant']:<16} {row['error']}")
            continue
        ranks = " ".join(f"{t:.2f}" for t in row["per_rank_us"])
        print(f"  {row['variant']:<16} slowest {row['median_us']:.2f}  (ranks {ranks})  "
              f"{row['speedup_vs_reference']:.2f}x the reference")
    return 0 if result["rows"][0]["error"] is None else 1
