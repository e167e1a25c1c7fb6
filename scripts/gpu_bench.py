"""Driver of scripts/gpu_bench.sh: every fusion point through `workbench bench`, one process per run.

Each point runs in its own process (a crash, a hang or a poisoned CUDA context costs that point only)
under a global deadline that keeps the whole command inside the device's 10-minute limit: when
little time is left a point is timed with its reference only, and when none is left it is skipped,
each with the reason in its row. The rows are merged into one bench.json + report.md per output
folder; then one point is run again and the two runs' medians compared (the run-to-run spread).
Never edits sources, never runs anything but `workbench bench`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = [  # (point, layer): attention and qk_prep differ between sliding and full layers
    ("boundary", "sliding"), ("qkvg_proj", "sliding"), ("qk_prep", "sliding"), ("qk_prep", "full"),
    ("attention", "sliding"), ("attention", "full"), ("attn_out", "sliding"), ("route", "sliding"),
    ("experts", "sliding"), ("dense_mlp", "sliding"), ("head", "sliding"), ("sample", "sliding"),
]
LAYERED = {"attention", "qk_prep"}


def log(msg: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def bench_once(args, point: str, layer: str, variants: list[str], out: Path, timeout: float) -> tuple[list, str]:
    """Runs one `workbench bench`; returns (rows, command). Failure -> one error row per variant."""
    cmd = [sys.executable, "-m", "workbench.cli", "bench", point, "--preset", args.preset,
           "--batch", str(args.batch), "--context", str(args.context), "--layer", layer, "--dtype", "bf16",
           "--device", args.device, "--graph" if args.device.startswith("cuda") else "--no-graph",
           *([] if variants == ["all"] else ["--variants", *variants]), "--max-seconds", str(args.max_seconds),
           "--out", str(out), "--json"]
    shown = shlex.join(["workbench", *cmd[3:]])
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(out / "stderr.log", "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)  # own process group: a timeout kills its compile workers too
        try:
            stdout, _ = proc.communicate(timeout=timeout)
            error = None if proc.returncode in (0, 1) else f"exit code {proc.returncode} (see {out}/stderr.log)"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, _ = proc.communicate()
            error = f"timed out after {timeout:.0f} s"
    log(f"{point} ({layer}): {time.monotonic() - started:.0f} s" + (f", {error}" if error else ""))
    if error is None:
        try:
            return json.loads(stdout)["rows"], shown
        except (ValueError, KeyError):
            error = f"unreadable output (see {out}/stderr.log)"
    rows = [{"point": point, "variant": v, "backend": None, "shape": f"{args.preset} b{args.batch} {layer}",
             "batch": args.batch, "dtype": "bf16", "median_us": None, "p10_us": None, "p90_us": None,
             "floor_us": None, "speedup_vs_reference": None, "error": error} for v in variants]
    return rows, shown


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default="bench-tp8-b1")
    p.add_argument("--runs-dir", default="runs", help="committed results folder (default: %(default)s)")
    p.add_argument("--preset", default="beam-501b-tp8")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--device", default="cuda", help="cuda (default); cpu only to smoke-test this script")
    p.add_argument("--variants", nargs="+", default=["all"], help="variant names, or all (default)")
    p.add_argument("--max-seconds", type=float, default=1.0, help="timing budget per variant")
    p.add_argument("--budget-s", type=float, default=450,
                   help="deadline of both passes; the device allows 600 s a command (default: %(default)s)")
    p.add_argument("--repeat-reserve-s", type=float, default=60, help="kept for the repeat (default: %(default)s)")
    p.add_argument("--point-timeout-s", type=float, default=120)
    p.add_argument("--repeat", default="boundary", help="point to run twice (default: %(default)s)")
    p.add_argument("--points", nargs="+", default=None, help="only these points (default: all)")
    args = p.parse_args()

    outs = [Path(os.environ["OUT"]) / args.name] if os.environ.get("OUT") else []
    outs.append(ROOT / args.runs_dir / args.name)
    primary = outs[0]
    if os.environ.get("OUT"):  # the device machine keeps nothing: measure the ceilings once, bring them back
        os.environ.setdefault("BEAM_WORKBENCH_CACHE", str(primary / "cache"))
    end = time.monotonic() + args.budget_s
    deadline = end - args.repeat_reserve_s  # of the main pass

    rows, commands = [], []
    for point, layer in RUNS:
        if args.points and point not in args.points:
            continue
        left = deadline - time.monotonic()
        label = f"{point}-{layer}" if point in LAYERED else point
        if left < 20:
            log(f"{label}: skipped, time budget spent")
            rows += [{"point": point, "variant": v, "shape": layer, "median_us": None,
                      "error": "skipped: time budget spent"} for v in args.variants]
            continue
        # torch.compile costs tens of seconds per point: without that much left, time the reference only.
        variants = args.variants if left > 75 else ["torch"]
        got, cmd = bench_once(args, point, layer, variants, primary / "points" / label,
                              min(args.point_timeout_s, left))
        if variants != args.variants:
            for r in got:
                r["note"] = "reference only: time budget"
        rows += got
        commands.append(cmd)

    repeat = {}
    r_layer = "sliding"
    first = {r["variant"]: r["median_us"] for r in rows if r["point"] == args.repeat and r.get("median_us")
             and (args.repeat not in LAYERED or r_layer in r.get("shape", ""))}
    left = end - time.monotonic()
    if first and left > 20:
        again, cmd = bench_once(args, args.repeat, r_layer, list(first), primary / "points" / f"{args.repeat}-repeat",
                                min(args.point_timeout_s, left))
        second = {r["variant"]: r.get("median_us") for r in again}
        repeat = {"point": args.repeat, "command": cmd, "first_us": first, "second_us": second,
                  "relative_difference": {v: abs(first[v] - second[v]) / min(first[v], second[v])
                                          for v in first if first[v] and second.get(v)}}

    from workbench.bench import environment, report_table, write_results

    env = environment(args.device)
    command = "bash scripts/gpu_bench.sh " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    for out in outs:
        write_results(rows, out, command.strip(), env, extra={"commands": commands, "repeat": repeat})
        if repeat:
            with open(out / "report.md", "a") as f:
                f.write(f"\n## Repeat of {args.repeat}\n\n```\n{repeat['command']}\n```\n\n"
                        "| variant | first us | second us | relative difference |\n|---|---|---|---|\n")
                for v, a in repeat["first_us"].items():
                    b, d = repeat["second_us"].get(v), repeat["relative_difference"].get(v)
                    f.write(f"| {v} | {a} | {b} | {'' if d is None else f'{d:.1%}'} |\n")
        log(f"wrote {out}/bench.json and {out}/report.md")

    print(report_table(rows))
    if repeat:
        print(f"repeat of {args.repeat}: " + ", ".join(f"{v} {d:.1%}" for v, d in repeat["relative_difference"].items()))
    return 0 if all(r.get("median_us") for r in rows if r["variant"] == "torch") else 1


if __name__ == "__main__":
    sys.exit(main())
