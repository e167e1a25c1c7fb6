"""The README's results table quotes the committed optimize reports: a re-lock that changes a report
must change the README too, and no figure there is typed in apart from its file."""

import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = os.path.join(ROOT, "workbench", "variants")


def _section(heading: str) -> str:
    """The README's text under `heading`, up to the next section."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def _results_rows() -> dict[str, str]:
    section = _section("## Results on one H200")
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z0-9-]+)` \|.*$", section, re.M)}


def _figures(report: dict) -> list[str]:
    """Every figure the README's row quotes, formatted as the report renders them."""
    figures = [f"{report['reference_ms']:.3f} ms", f"{report['locked_ms']:.3f} ms",
               f"{report['speedup']:.2f}x the reference", f"{report['floor_ms']:.3f} ms",
               f"{round(100 * report['fraction_of_floor'])}%"]
    for baseline in report["torch_compile_baselines"]:
        figures += [f"{baseline['ms']:.3f} ms", f"{baseline['speedup']:.2f}x"]
    return figures


def test_results_table_quotes_the_committed_reports():
    rows = _results_rows()
    assert set(rows) == {"decode-b1", "prefill-8x2k"}
    for target, row in rows.items():
        folder = re.search(r"`(runs/optimize-[^`]+)/`", row).group(1)
        report = json.load(open(os.path.join(ROOT, folder, "report.json"), encoding="utf-8"))
        assert report["target"] == target
        missing = [f for f in _figures(report) if f not in row]
        assert not missing, f"README's {target} row lacks {missing} from {folder}/report.json"


def _table(heading: str) -> list[list[str]]:
    rows = [line for line in _section(heading).splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_variants_table_matches_the_registry_and_both_locks():
    import yaml

    from workbench import registry
    from workbench.lock import run_by

    locks = []
    for name in ("optimize-decode-b1-beam-501b-tp8", "optimize-prefill-8x2k-beam-501b-tp8"):
        points = yaml.safe_load(open(os.path.join(ROOT, "runs", name, "lock.yaml"), encoding="utf-8"))["points"]
        selection = {point: entry["variant"] for point, entry in points.items()}
        locks.append((selection, run_by(selection)))
    rows = _table("## Fusion points and variants")
    assert [row[0].strip("`") for row in rows] == list(registry.POINTS)
    for point_cell, names, *choices in rows:
        point = point_cell.strip("`")
        shipped = [n for n, v in registry.variants(point).items()
                   if os.path.dirname(v.source_file) == os.path.join(VARIANTS, point)]
        # Sets: tests register variants of their own, and importing a variant module first reorders them
        assert sorted(names.split(", ")) == sorted(shipped), point
        for cell, (selection, by) in zip(choices, locks):
            # "-": a point added after the lock, which its step never calls (a drafter's)
            expected = f"run by `{by[point].split(':')[0]}`" if point in by else selection.get(point, "-")
            assert cell.split(" (")[0] == expected, (point, cell, expected)


def test_runs_readme_lists_every_run_folder():
    """Each folder under runs/ is a current result with its command: runs/README.md names every one."""
    listed = open(os.path.join(ROOT, "runs", "README.md"), encoding="utf-8").read()
    folders = [d for d in sorted(os.listdir(os.path.join(ROOT, "runs")))
               if os.path.isdir(os.path.join(ROOT, "runs", d))]
    assert folders and not [d for d in folders if f"`{d}/`" not in listed]
