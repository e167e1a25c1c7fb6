"""The result files and tables of a bench: bench.json, report.md, and the kernels each variant launches.

Presentation and persistence of `workbench.bench`'s rows: it never times anything, and never writes
a figure that is not in the rows.
"""

from __future__ import annotations

import json
from pathlib import Path

from workbench.provenance import environment
from workbench.run_folder import write_json


def top_kernels(kernels: list[dict], top: int = 10) -> list[tuple[str, str, str]]:
    """(kernel, launches, us) cells of the `top` kernels by time, then one row summing the rest; C++
    kernel names shortened (bench.json keeps them whole)."""
    from workbench.profiler.trace import short_name

    rest = kernels[top:]
    rows = [(short_name(k["kernel"]), k["launches"], k["us"]) for k in kernels[:top]]
    if rest:
        rows.append((f"{len(rest)} more", sum(k["launches"] for k in rest), sum(k["us"] for k in rest)))
    return [(name, f"{launches:g}", f"{us:.2f}") for name, launches, us in rows]


def kernels_table(rows: list[dict]) -> str:
    """Markdown: each row's kernels per call (from `bench --kernels`)."""
    lines = []
    for r in rows:
        if r.get("kernels") is None and not r.get("kernels_error"):
            continue
        label = r["variant"] + (f" `{config_text(r['config'])}`" if r.get("config") else "")
        lines += ["", f"### {label}", ""]
        if r.get("kernels_error"):
            lines.append(f"kernels not listed: {r['kernels_error']}")
            continue
        lines += ["| kernel | launches per call | us per call |", "|---|---:|---:|"]
        lines += [f"| `{name[:120]}` | {launches} | {us} |" for name, launches, us in top_kernels(r["kernels"])]
    return "\n".join(lines)


def config_text(config: dict) -> str:
    """A tuning config on one line, as a row names it."""
    return json.dumps(config, separators=(",", ":"))


def report_table(rows: list[dict]) -> str:
    """The rows as a markdown table (missing fields left blank)."""
    cols = [("point", "point", None), ("variant", "variant", None), ("backend", "backend", None),
            ("shape", "shape", None), ("median us", "median_us", ".2f"), ("p10 us", "p10_us", ".2f"),
            ("p90 us", "p90_us", ".2f"), ("spread", "spread", ".1%"), ("floor us", "floor_us", ".2f"),
            ("% of floor", "pct_of_floor", ".1f"), ("first call ms", "first_call_ms", ".1f"),
            ("vs reference", "speedup_vs_reference", ".2f")]
    lines = ["| " + " | ".join(c[0] for c in cols) + " | note |", "|" + "---|" * (len(cols) + 1)]
    for r in rows:
        cells = ["" if r.get(k) is None else format(r[k], f) if f else str(r[k]) for _, k, f in cols]
        if r.get("config"):
            cells[1] += f" `{config_text(r['config'])}`"
        if cells[-1]:
            cells[-1] += "x"
        note = r.get("error") or (f"graph fallback: {r['graph_error']}" if r.get("graph_error") else "")
        note = "; ".join(x for x in (note, r.get("note")) if x)
        lines.append("| " + " | ".join(cells + [note.replace("|", "/")]) + " |")
    return "\n".join(lines)


def write_results(rows: list[dict], out_dir, command: str, env: dict | None = None,
                  extra: dict | None = None) -> dict[str, Path]:
    """bench.json ({"command", "environment", "rows", **extra}) and report.md under `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = env or environment()
    doc = {"command": command, "environment": env, "rows": rows, **(extra or {})}
    write_json(out / "bench.json", doc)
    md = [f"# Bench: {out.name}", "", "```", command, "```", "", "## Environment", ""]
    md += [f"- {k}: {v}" for k, v in env.items()]
    md += ["", "## Results", "", "Times in microseconds (median of reps; spread = (p90 - p10) / median); "
           "floor = max(bytes / copy bandwidth, FLOPs / bf16 matmul rate); speed-ups are ratios "
           "within this run.", "", report_table(rows), ""]
    kernels = kernels_table(rows)
    if kernels:
        md += ["## Kernels per call", "", "One eager call of each variant under torch.profiler (device time; "
               "ATen ops on a CPU), after its timing.", kernels, ""]
    (out / "report.md").write_text("\n".join(md))
    return {"bench.json": out / "bench.json", "report.md": out / "report.md"}
