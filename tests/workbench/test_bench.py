"""Benching a point (workbench/bench.py, workbench/bench_report.py) and the `bench` / `variants list` commands,
on the CPU.

Where a point's real PointSpec has not been declared yet, `boundary` gets a small stand-in here (only
for the test's duration), written against the PointSpec interface.
"""

import json

import pytest
import torch
from harness_helpers import CEILINGS, FAST

from workbench import bench, bench_report, points, registry
from workbench.cli import main
from workbench.dtypes import DTYPES
from workbench.points import Call, PointSpec, Workload
from workbench.roofline import device_name, floor_us


def _boundary_inputs(workload, device, seed):
    c, g = workload.config, torch.Generator().manual_seed(seed)
    dtype = DTYPES[workload.dtype]

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt)

    w = {"post_norm": rand(c.hidden_size), "next_norm": rand(c.hidden_size),
         "residual": torch.tensor([0.9, 0.4], device=device)}
    return Call((rand(workload.tokens, c.hidden_size), rand(workload.tokens, c.hidden_size), w),
                {"eps": c.rms_norm_eps}, weights_arg=2)


def _boundary_bytes(w):
    h = w.config.hidden_size
    return 2 * (4 * w.tokens * h + 2 * h) + 8


STAND_IN = PointSpec("boundary", _boundary_inputs, _boundary_bytes, lambda w: 12 * w.tokens * w.config.hidden_size,
                     tolerance={"bf16": 1e-2, "fp32": 1e-5})


@pytest.fixture
def boundary_spec(monkeypatch):
    try:
        return points.spec("boundary")
    except KeyError:
        monkeypatch.setitem(points._SPECS, "boundary", STAND_IN)
        return STAND_IN


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """Ceilings cache in a temp dir, pre-seeded for the CPU so CLI runs don't spend time measuring."""
    monkeypatch.setenv("BEAM_WORKBENCH_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "ceilings.json").write_text(json.dumps({device_name("cpu"): CEILINGS}))
    return tmp_path / "cache"


def _add_variant(monkeypatch, point, name, backend, fn, **kw):
    registry.variants(point)
    monkeypatch.setitem(registry._VARIANTS[point], name, registry.Variant(point, name, backend, fn, **kw))


def test_bench_point_rows(boundary_spec, monkeypatch):
    ref = registry.reference("boundary")

    def packed(y, h, w, **kw):
        assert "packed" in w  # the weight-layout transform ran before the call
        return ref.fn(y, h, w, **kw)

    def broken(y, h, w, **kw):
        raise RuntimeError("planted failure")

    _add_variant(monkeypatch, "boundary", "packed", "torch", packed, prepare=lambda w: {**w, "packed": True})
    _add_variant(monkeypatch, "boundary", "broken", "torch", broken)
    _add_variant(monkeypatch, "boundary", "picky", "torch", packed, supports=lambda w: "needs hidden >= 4096")
    workload = Workload(preset="beam-tiny", batch=2, dtype="fp32")
    rows = bench.bench_point("boundary", ["packed", "broken", "picky"], workload, device="cpu",
                             ceilings=CEILINGS, rotate_bytes=1 << 16, **FAST)
    assert [r["variant"] for r in rows] == ["torch", "packed", "broken", "picky"]  # reference always, first
    for r in rows:
        assert set(bench.ROW_FIELDS) <= set(r)
        assert r["shape"] == workload.label() and r["batch"] == 2 and r["dtype"] == "fp32"
        assert r["floor_us"] == pytest.approx(floor_us(boundary_spec, workload, CEILINGS))
    torch_row, packed_row, broken_row, picky_row = rows
    assert torch_row["speedup_vs_reference"] == 1.0 and torch_row["error"] is None
    assert torch_row["first_call_ms"] > 0  # apart from the run time, for every timed row
    assert all(r.get("first_call_ms") is None for r in rows if r["error"])
    assert torch_row["p10_us"] <= torch_row["median_us"] <= torch_row["p90_us"]
    assert torch_row["pct_of_floor"] == pytest.approx(100 * torch_row["floor_us"] / torch_row["median_us"])
    assert packed_row["error"] is None and packed_row["speedup_vs_reference"] > 0
    assert "planted failure" in broken_row["error"] and broken_row["median_us"] is None
    assert broken_row["speedup_vs_reference"] is None
    assert picky_row["error"] == "unavailable: needs hidden >= 4096"


def test_bench_point_times_each_config_and_gates_it(boundary_spec, monkeypatch):
    """--configs / --config: a row per (variant, config); with gate=True a config that computes the
    wrong thing is named by the op gate and never timed; a config-less variant cannot take one."""
    ref = registry.reference("boundary")

    def at(config):
        if config.get("wrong"):
            return lambda y, h, w, **kw: tuple(None if t is None else t * 1.5 for t in ref.fn(y, h, w, **kw))
        return ref.fn

    _add_variant(monkeypatch, "boundary", "tuned", "torch", ref.fn, configs=[{"block": 1}, {"block": 2}],
                 configure=at)
    _add_variant(monkeypatch, "boundary", "plain", "torch", ref.fn)
    workload = Workload(preset="beam-tiny", dtype="fp32")
    kw = dict(device="cpu", ceilings=CEILINGS, rotate_bytes=0, **FAST)
    rows = bench.bench_point("boundary", ["tuned", "plain"], workload, configs="all", **kw)
    assert [(r["variant"], r["config"]) for r in rows] == \
        [("torch", None), ("tuned", {"block": 1}), ("tuned", {"block": 2}), ("plain", None)]
    assert all(r["error"] is None and r["median_us"] > 0 for r in rows)
    rows = bench.bench_point("boundary", ["tuned", "plain"], workload, configs=[{"block": 8}, {"wrong": True}],
                             gate=True, **kw)
    by = {(r["variant"], json.dumps(r["config"])): r for r in rows}
    assert by[("tuned", '{"block": 8}')]["gate"] == "pass" and by[("tuned", '{"block": 8}')]["median_us"] > 0
    wrong = by[("tuned", '{"wrong": true}')]
    assert wrong["error"].startswith("fails the op gate: ") and wrong["median_us"] is None
    assert by[("plain", '{"block": 8}')]["error"] == "boundary:plain takes no tuning config"
    assert "`{\"block\":8}`" in bench_report.report_table(rows)


def test_bench_point_lists_each_variants_kernels_per_call(boundary_spec, monkeypatch, tmp_path):
    """`--kernels`: what one call launches (ATen ops on the CPU), per call: a variant that runs the
    reference twice lists each of its ops twice as often; a profiler failure is noted, the timing kept."""
    ref = registry.reference("boundary").fn

    def twice(y, h, w, **kw):
        ref(y, h, w, **kw)
        return ref(y, h, w, **kw)

    _add_variant(monkeypatch, "boundary", "twice", "torch", twice)
    workload = Workload(preset="beam-tiny", batch=2, dtype="fp32")
    rows = bench.bench_point("boundary", ["twice"], workload, device="cpu", ceilings=CEILINGS, kernels=True, **FAST)
    once, twice = ({k["kernel"]: k for k in r["kernels"]} for r in rows)
    assert once and set(once) == set(twice)
    assert all(k["launches"] > 0 and k["us"] > 0 for k in once.values())
    assert all(twice[name]["launches"] == 2 * k["launches"] for name, k in once.items())
    assert [k["us"] for k in rows[0]["kernels"]] == sorted((k["us"] for k in rows[0]["kernels"]), reverse=True)
    md = bench_report.write_results(rows, tmp_path, "workbench bench boundary --kernels")["report.md"].read_text()
    assert "## Kernels per call" in md and "### twice" in md and f"`{rows[0]['kernels'][0]['kernel']}`" in md

    def broken(fn, device, calls=5):
        raise RuntimeError("planted profiler failure")

    monkeypatch.setattr("workbench.profiler.kernels_per_call", broken)
    row = bench.bench_point("boundary", ["torch"], workload, device="cpu", ceilings=CEILINGS, kernels=True, **FAST)[0]
    assert row["median_us"] > 0 and "planted profiler failure" in row["kernels_error"] and "kernels" not in row


def test_kernels_are_listed_in_inference_mode_as_the_timing_ran(boundary_spec, monkeypatch):
    """A variant's workspace made during the (inference-mode) timing is an inference tensor: listing
    its kernels outside inference mode failed to write it (FlashInfer's prefill wrapper keeps one)."""
    ref, workspace = registry.reference("boundary").fn, []

    def keeps_a_workspace(y, h, w, **kw):
        if not workspace:
            workspace.append(torch.zeros(1))
        workspace[0].add_(1)
        return ref(y, h, w, **kw)

    _add_variant(monkeypatch, "boundary", "workspace", "torch", keeps_a_workspace)
    workload = Workload(preset="beam-tiny", batch=2, dtype="fp32")
    row = bench.bench_point("boundary", ["workspace"], workload, device="cpu", ceilings=CEILINGS, kernels=True,
                            **FAST)[1]
    assert workspace[0].is_inference() and "kernels_error" not in row and row["kernels"], row.get("kernels_error")


def test_top_kernels_sums_the_rest():
    kernels = [{"kernel": f"k{i}", "launches": 1.0, "us": 10.0 - i} for i in range(5)]
    assert bench_report.top_kernels(kernels, top=2) == \
        [("k0", "1", "10.00"), ("k1", "1", "9.00"), ("3 more", "3", "21.00")]
    assert bench_report.top_kernels(kernels[:2], top=2) == [("k0", "1", "10.00"), ("k1", "1", "9.00")]


def test_bench_cli_config_errors(capsys):
    argv = ["bench", "boundary", "--preset", "beam-tiny", "--device", "cpu"]
    for extra, message in [(["--config", '{"BLOCK": 64}'], "--config applies to the variants named with --variants"),
                           (["--variants", "triton", "--config", "{BLOCK: 64}"], "is not JSON"),
                           (["--variants", "triton", "--config", "[64]"], "must be a non-empty JSON object")]:
        assert main([*argv, *extra]) != 0
        assert message in capsys.readouterr().err


def test_bench_point_unavailable_backend(boundary_spec, monkeypatch):
    monkeypatch.setattr(registry, "backend_available", lambda b: (b != "cute", "no cutlass here"))
    _add_variant(monkeypatch, "boundary", "cute_fused", "cute", lambda *a, **k: None)
    rows = bench.bench_point("boundary", ["cute_fused"], Workload(preset="beam-tiny"), device="cpu",
                             ceilings=CEILINGS, rotate_bytes=0, **FAST)
    assert rows[1]["error"] == "unavailable: no cutlass here" and rows[0]["error"] is None


def test_write_results_files_parse(tmp_path):
    rows = [{**dict.fromkeys(bench.ROW_FIELDS), "point": "boundary", "variant": "torch", "backend": "torch",
             "shape": "beam-tiny b1", "median_us": 3.0, "p10_us": 2.5, "p90_us": 3.5, "spread": 0.33,
             "floor_us": 1.0, "pct_of_floor": 33.3, "speedup_vs_reference": 1.0, "error": None},
            {**dict.fromkeys(bench.ROW_FIELDS), "point": "boundary", "variant": "bad", "backend": "triton",
             "shape": "beam-tiny b1", "error": "unavailable: a | b"}]
    paths = bench_report.write_results(rows, tmp_path / "run", "workbench bench boundary --device cpu")
    doc = json.loads(paths["bench.json"].read_text())
    assert doc["command"] == "workbench bench boundary --device cpu" and doc["rows"] == rows
    assert {"gpu", "driver", "torch", "triton", "flashinfer", "cutlass", "git_commit", "hostname", "date"} \
        <= set(doc["environment"])
    md = paths["report.md"].read_text()
    assert md.index("workbench bench boundary --device cpu") < md.index("## Environment") < md.index("| boundary")
    assert md.count("\n| boundary") == 2


def test_variants_list_json(capsys):
    assert main(["variants", "list", "--json", "--device", "cpu"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["point"] for p in doc["points"]] == list(registry.POINTS) and len(doc["points"]) == 12
    for p in doc["points"]:
        names = {v["name"]: v for v in p["variants"]}
        assert {"torch", "torch_compile"} <= set(names)
        assert names["torch"]["backend"] == "torch" and names["torch"]["available"]
        assert names["torch_compile"]["backend"] == "torch_compile"


def test_bench_cli_json(boundary_spec, cache_dir, tmp_path, capsys, monkeypatch):
    # As on this machine outside pytest: Triton variants unavailable (conftest turns on the interpreter).
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "runs" / "cli"
    argv = ["bench", "boundary", "--preset", "beam-tiny", "--device", "cpu", "--json",
            "--max-seconds", "0.3", "--min-reps", "20", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["variant"]: r for r in doc["rows"]}
    assert {"torch", "torch_compile"} <= set(rows) and rows["torch_compile"]["median_us"] > 0
    assert all(r["median_us"] or r["error"].startswith("unavailable") for r in doc["rows"])
    assert rows["torch"]["speedup_vs_reference"] == 1.0 and rows["torch"]["median_us"] > 0
    assert rows["torch"]["floor_us"] > 0 and rows["torch"]["shape"].startswith("beam-tiny b1 decode ctx4096")
    assert doc["command"].startswith("workbench bench boundary --preset beam-tiny")
    assert json.loads((out / "bench.json").read_text())["rows"] == doc["rows"]
    assert (out / "report.md").read_text().count("\n| boundary") == len(doc["rows"])


def test_bench_cli_shape_preset_alias_and_table(boundary_spec, cache_dir, capsys):
    argv = ["bench", "boundary", "--shape-preset", "beam-tiny", "--device", "cpu", "--variants", "torch",
            "--dtype", "fp32", "--max-seconds", "0.1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "boundary" in out and "torch" in out and "1.00x" in out and "kernels per call" not in out
    assert main(argv + ["--kernels"]) == 0
    out = capsys.readouterr().out
    assert "torch: kernels per call" in out and "aten::" in out
