"""The per-op timing harness (workbench/bench.py) and the `bench` / `variants list` commands, on the CPU.

Where a point's real PointSpec has not been declared yet, `boundary` gets a small stand-in here (only
for the test's duration), written against the PointSpec interface.
"""

import json
import math
import time
from types import SimpleNamespace

import pytest
import torch

from workbench import bench, points, registry
from workbench.cli import main
from workbench.points import Call, PointSpec, Workload

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FAST = dict(warmup=2, min_reps=10, max_reps=60, max_seconds=0.2)  # timing knobs that keep tests quick
CEILINGS = {"bandwidth_Bps": 1e11, "matmul_flops": 1e12}


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
    (tmp_path / "cache" / "ceilings.json").write_text(json.dumps({bench.device_name("cpu"): CEILINGS}))
    return tmp_path / "cache"


def _add_variant(monkeypatch, point, name, backend, fn, **kw):
    registry.variants(point)
    monkeypatch.setitem(registry._VARIANTS[point], name, registry.Variant(point, name, backend, fn, **kw))


# ---- time_call ---------------------------------------------------------------------------------------

def test_time_call_trivial_function_gives_sane_stats():
    x = torch.randn(256)
    t = bench.time_call(lambda a: a + 1, lambda i: Call((x,)), device="cpu", rotate_bytes=0, **FAST)
    assert 0 < t.p10_us <= t.median_us <= t.p90_us < 1e6
    assert t.spread == pytest.approx((t.p90_us - t.p10_us) / t.median_us)
    assert 10 <= t.reps <= 60 and len(t.samples_us) == t.reps
    assert t.copies == 1 and not t.graph and not t.l2_flush


def test_time_call_measures_microseconds():
    t = bench.time_call(lambda: time.sleep(0.002), lambda i: Call(()), device="cpu", rotate_bytes=0,
                        warmup=1, min_reps=5, max_reps=5, max_seconds=1)
    assert 2000 <= t.median_us < 200_000
    assert t.reps == 5


def test_first_call_is_reported_apart_from_the_run_time():
    """A JIT build or compile on the first call shows in first_call_ms and never in the samples."""
    made = []

    def builds_once():
        if not made:
            made.append(1)
            time.sleep(0.2)  # the "JIT build"

    t = bench.time_call(builds_once, lambda i: Call(()), device="cpu", rotate_bytes=0, warmup=1, min_reps=5,
                        max_reps=5, max_seconds=1)
    assert t.first_call_ms >= 200 and t.median_us < 50_000
    assert t.as_dict()["first_call_ms"] == t.first_call_ms


def test_time_call_stops_at_target_spread_and_falls_back_from_graphs_on_cpu():
    t = bench.time_call(lambda: None, lambda i: Call(()), device="cpu", rotate_bytes=0, use_graph=True,
                        warmup=1, min_reps=10, max_reps=10_000, target_spread=math.inf, max_seconds=5)
    assert t.reps == 10  # any spread meets an infinite target after min_reps
    assert not t.graph and "CUDA" in t.graph_error


def test_rotation_cycles_through_distinct_copies():
    made, seen = [], []

    def make_call(i):
        made.append(i)
        return Call((torch.full((1024,), float(i)),))  # 4 KiB per copy

    def fn(x):
        seen.append(x.data_ptr())
        return x

    t = bench.time_call(fn, make_call, device="cpu", rotate_bytes=5 * 4096, warmup=0, min_reps=20, max_reps=20)
    assert t.copies == 5 and made == [0, 1, 2, 3, 4] and t.copy_bytes == 4096
    assert len(set(seen)) == 5
    timed = seen[-20:]
    assert all(timed[j] == timed[j % 5] for j in range(20))  # round robin, every copy in turn
    assert len(set(timed[:5])) == 5


def test_rotation_is_sized_by_touched_bytes_and_capped():
    make = lambda i: Call((torch.zeros(1024),))  # noqa: E731
    t = bench.time_call(lambda x: x, make, device="cpu", rotate_bytes=4096, touched_bytes=1024, **FAST)
    assert t.copies == 4  # only a quarter of each copy is touched per call: 4 copies to cover 4 KiB
    t = bench.time_call(lambda x: x, make, device="cpu", rotate_bytes=1 << 30, max_copies=3, **FAST)
    assert t.copies == 3


def test_call_bytes_counts_shared_storage_once_and_walks_containers():
    a = torch.zeros(100)
    call = Call((a, a[:10], {"w": [torch.zeros(10, dtype=torch.float64)]}), {"k": torch.zeros(5)})
    assert bench.call_bytes(call) == 400 + 80 + 20


# ---- noise band, compare ---------------------------------------------------------------------------------

def test_compare_and_noise_band():
    assert bench.relative_difference(100, 110) == pytest.approx(0.1)
    assert bench.compare(90.0, 100.0, 0.05)        # 10% faster beats a 5% band
    assert not bench.compare(97.0, 100.0, 0.05)    # 3% is inside the band
    assert not bench.compare(110.0, 100.0, 0.0)    # slower never wins
    fast = bench.Timing(50.0, 49.0, 51.0, 0.04, 10, 1, 1, 1, False)
    slow = bench.Timing(60.0, 59.0, 61.0, 0.03, 10, 1, 1, 1, False)
    assert bench.compare(fast, slow, 0.1) and not bench.compare(slow, fast, 0.1)
    x = torch.randn(4096)
    band = bench.noise_band(torch.sin, lambda i: Call((x,)), device="cpu", rotate_bytes=0, **FAST)
    assert band >= 0 and math.isfinite(band)  # its size depends on what else runs on this machine


def test_noise_band_is_two_independent_runs(monkeypatch):
    medians = iter([100.0, 104.0])
    runs = []

    def fake_time_call(fn, make_call, **kw):
        runs.append(kw)
        return bench.Timing(next(medians), 0, 0, 0, 1, 1, 1, 1, False)

    monkeypatch.setattr(bench, "time_call", fake_time_call)
    assert bench.noise_band(None, None, device="cpu", warmup=3) == pytest.approx(0.04)
    assert runs == [{"device": "cpu", "warmup": 3}] * 2


# ---- roofline -------------------------------------------------------------------------------------------

def test_floor_is_the_larger_of_memory_and_compute_time():
    ceilings = {"bandwidth_Bps": 4e12, "matmul_flops": 1e15}
    memory_bound = PointSpec("head", None, lambda w: 8_000_000_000, lambda w: 10**12, tolerance={})
    assert bench.floor_us(memory_bound, Workload(), ceilings) == pytest.approx(2000.0)  # 2 ms of bytes vs 1 ms
    compute_bound = PointSpec("head", None, lambda w: 10**6, lambda w: 5 * 10**12, tolerance={})
    assert bench.floor_us(compute_bound, Workload(), ceilings) == pytest.approx(5000.0)


def test_ceilings_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("BEAM_WORKBENCH_CACHE", str(tmp_path / "c"))
    calls = []
    monkeypatch.setattr(bench, "_measure", lambda device: calls.append(device) or dict(CEILINGS))
    assert bench.measure_device_ceilings("cpu") == CEILINGS and len(calls) == 1
    assert bench.measure_device_ceilings("cpu") == CEILINGS and len(calls) == 1  # from the file now
    saved = json.loads((tmp_path / "c" / "ceilings.json").read_text())
    assert saved[bench.device_name("cpu")]["bandwidth_Bps"] == CEILINGS["bandwidth_Bps"]
    bench.measure_device_ceilings("cpu", refresh=True)
    assert len(calls) == 2


def test_measured_cpu_ceilings_are_positive(tmp_path, monkeypatch):
    monkeypatch.setenv("BEAM_WORKBENCH_CACHE", str(tmp_path))
    c = bench.measure_device_ceilings("cpu")
    assert c["bandwidth_Bps"] > 1e8 and c["matmul_flops"] > 1e7


# ---- bench_point, results -----------------------------------------------------------------------------------

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
        assert r["floor_us"] == pytest.approx(bench.floor_us(boundary_spec, workload, CEILINGS))
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
    assert "`{\"block\":8}`" in bench.report_table(rows)


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
    md = bench.write_results(rows, tmp_path, "workbench bench boundary --kernels")["report.md"].read_text()
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
    assert bench.top_kernels(kernels, top=2) == [("k0", "1", "10.00"), ("k1", "1", "9.00"), ("3 more", "3", "21.00")]
    assert bench.top_kernels(kernels[:2], top=2) == [("k0", "1", "10.00"), ("k1", "1", "9.00")]


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
    paths = bench.write_results(rows, tmp_path / "run", "workbench bench boundary --device cpu")
    doc = json.loads(paths["bench.json"].read_text())
    assert doc["command"] == "workbench bench boundary --device cpu" and doc["rows"] == rows
    assert {"gpu", "driver", "torch", "triton", "flashinfer", "cutlass", "git_commit", "hostname", "date"} \
        <= set(doc["environment"])
    md = paths["report.md"].read_text()
    assert md.index("workbench bench boundary --device cpu") < md.index("## Environment") < md.index("| boundary")
    assert md.count("\n| boundary") == 2


# ---- CLI -----------------------------------------------------------------------------------------------

def test_variants_list_json(capsys):
    assert main(["variants", "list", "--json", "--device", "cpu"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["point"] for p in doc["points"]] == list(registry.POINTS) and len(doc["points"]) == 11
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


def test_slow_make_call_is_completed_with_clones():
    made = []

    def make_call(i):
        made.append(i)
        return Call((torch.full((1024,), float(i)),), {"meta": {"ids": torch.arange(3)}})

    seen = []
    t = bench.time_call(lambda x, meta: seen.append((x.data_ptr(), meta["ids"].data_ptr())), make_call,
                        device="cpu", rotate_bytes=6 * 4096, make_seconds=0, warmup=0, min_reps=6, max_reps=6)
    assert made == [0] and t.copies == 6 and t.fresh_copies == 1
    assert len(set(seen[-6:])) == 6  # clones live in their own memory, nested tensors included


def test_recompiles_while_sampling_are_counted():
    """A compiled callable that recompiles during the timed reps has no valid time: the harness says so."""
    import itertools

    from workbench.bench import time_call
    from workbench.points import Call

    n = itertools.count()
    shifting = torch.compile(lambda x, k: x + k, backend="eager", dynamic=False)  # new int constant: new graph
    stable = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    kw = dict(warmup=1, min_reps=4, max_reps=4, rotate_bytes=0)
    assert time_call(lambda x: shifting(x, next(n)), lambda i: Call((torch.ones(4),)), **kw).recompiles > 0
    assert time_call(stable, lambda i: Call((torch.ones(4),)), **kw).recompiles == 0


def test_slow_whole_steps_get_fewer_warmups_and_samples(monkeypatch):
    from workbench import bench

    assert bench.reps_for(0.004) == {"warmup": 10, "min_reps": 50}  # a decode step: the defaults
    assert bench.reps_for(0.04) == {"warmup": 10, "min_reps": 50}
    assert bench.reps_for(0.3) == {"warmup": 2, "min_reps": 6}    # a prefill: ~2 s of samples
    assert bench.reps_for(3.5) == {"warmup": 2, "min_reps": 5}    # never fewer than 5
    seen = {}
    monkeypatch.setattr(bench, "_first_call_ms", lambda fn, call, device: 500.0)
    monkeypatch.setattr(bench, "time_call", lambda *a, **kw: seen.update(kw) or SimpleNamespace(as_dict=dict))
    bench.time_fn(lambda: None)
    assert seen["warmup"] == 0 and seen["min_reps"] == 5 and seen["use_graph"] is False  # 2 calls made already


def test_git_tree_names_the_files_on_disk(tmp_path):
    """`git_tree` is the commit's tree for a clean checkout, and follows an edit the commit does not
    have (the GPU host's copy of the tree, whose .git is older than its files); ignored files do not
    count. The index of the checkout is left as it was."""
    import subprocess

    from workbench.bench import environment, git_tree

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / ".gitignore").write_text("*.trace.json\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    clean = git("rev-parse", "HEAD^{tree}")
    assert git_tree(tmp_path) == clean
    (tmp_path / "big.trace.json").write_text("{}")
    assert git_tree(tmp_path) == clean
    (tmp_path / "a.py").write_text("x = 2\n")
    edited = git_tree(tmp_path)
    assert edited not in (None, clean) and git("status", "--porcelain", "--untracked-files=no") == "M a.py"
    git("commit", "-qam", "two")
    assert git_tree(tmp_path) == edited == git("rev-parse", "HEAD^{tree}")
    assert git_tree(tmp_path / "missing") is None
    assert len(environment()["git_tree"] or "") in (0, 40)  # None outside a git checkout
