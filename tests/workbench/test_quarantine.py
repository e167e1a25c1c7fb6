"""A quarantined variant is left out of searches, `check` and `bench` with its reason, unless named."""

import pytest
import torch

from workbench import quarantine

PLANTED = ("qkvg_proj", "packed")  # a variant that runs on the CPU, quarantined there for the test


@pytest.fixture
def planted(monkeypatch):
    monkeypatch.setitem(quarantine.KNOWN, PLANTED, ("cpu", "quarantined: planted by the test"))


def test_only_on_its_device(planted):
    assert quarantine.quarantined(*PLANTED, torch.device("cpu")) == "quarantined: planted by the test"
    assert quarantine.quarantined(*PLANTED, "cuda:0") is None
    assert quarantine.quarantined("qkvg_proj", "torch", "cpu") is None


def test_search_leaves_it_out_and_keys_the_cache(tmp_path, monkeypatch):
    from beam_model import BeamForCausalLM
    from workbench.registry import get, variants
    from workbench.search import Search
    from workbench.targets import StepRunner, for_device, get_target

    model = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32)
    runner = StepRunner(model, for_device(get_target("decode-b1"), model.device))
    calls = {"qkvg_proj": {"sliding": 5, "full": 2}}
    free = Search(runner, calls=calls, out_dir=str(tmp_path)).fingerprint("qkvg_proj")
    torch_packings = (PLANTED, ("qkvg_proj", "packed_views"))  # every torch-backend variant besides the reference
    for planted in torch_packings:
        monkeypatch.setitem(quarantine.KNOWN, planted, ("cpu", "quarantined: planted by the test"))
    search = Search(runner, calls=calls, out_dir=str(tmp_path))
    assert search._unavailable(get(*PLANTED), search.workloads("qkvg_proj")) == "quarantined: planted by the test"
    kept = search.fingerprint("qkvg_proj")
    assert kept != free  # lifting the quarantine searches the point again
    # the same variant left out by --backends instead: the same candidates tried, the same cache key
    for planted in torch_packings:
        monkeypatch.delitem(quarantine.KNOWN, planted)
    others = tuple({v.backend for v in variants("qkvg_proj").values()} - {"torch"})  # both packings are torch's
    assert Search(runner, calls=calls, out_dir=str(tmp_path), backends=others).fingerprint("qkvg_proj") == kept


def _check_rows(argv):
    from workbench.cli import build_parser
    from workbench.commands.check import gate_all

    args = build_parser("check").parse_args(["check", *argv, "--no-capture", "--seeds", "1", "--batch", "1",
                                             "--prefill", "0", "0", "0"])
    return {r["variant"]: r for r in gate_all(args)}


def test_check_skips_it_unless_named(planted):
    rows = _check_rows(["qkvg_proj"])
    assert rows["packed"]["status"] == "skip" and "planted" in rows["packed"]["reason"]
    assert rows["torch"]["status"] == "pass"
    assert _check_rows(["qkvg_proj:packed"])["packed"]["status"] == "pass"


def test_bench_skips_it_unless_named(planted):
    from workbench.bench import bench_point
    from workbench.points import Workload

    wl = Workload(preset="beam-tiny", dtype="fp32")
    kw = dict(device="cpu", warmup=1, min_reps=3, max_reps=3)
    rows = {r["variant"]: r for r in bench_point("qkvg_proj", None, wl, **kw)}
    assert "planted" in rows["packed"]["error"] and rows["torch"]["median_us"]
    named = {r["variant"]: r for r in bench_point("qkvg_proj", ["packed"], wl, **kw)}
    assert named["packed"].get("error") is None and named["packed"]["median_us"]


def test_variants_list_shows_it_unavailable_with_the_evidence(planted):
    from workbench.commands.variants import listing

    rows = {r["name"]: r for p in listing("beam-tiny", torch.device("cpu")) if p["point"] == "qkvg_proj"
            for r in p["variants"]}
    assert not rows["packed"]["available"] and "planted" in rows["packed"]["reason"]
    assert rows["torch"]["available"]
