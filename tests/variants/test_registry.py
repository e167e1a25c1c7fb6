"""Registry selection and skipping: unknown names are errors, a variant that cannot run here is
skipped with its reason (missing backend, CPU-only run, its own `supports`), never silently used;
and `workbench check` reports all of it, failing on a bad variant."""

import json

import pytest
from planted import planted

from workbench import registry
from workbench.cli import main
from workbench.commands import check
from workbench.points import Workload
from workbench.registry import Variant, bind, get, variants


@pytest.fixture
def temporary():
    """Register variants for one test; removed after."""
    added = []

    def add(v: Variant) -> Variant:
        variants(v.point)[v.name] = v
        added.append(v)
        return v

    yield add
    for v in added:
        del variants(v.point)[v.name]


def _ref_fn(point):
    return registry.reference(point).fn


def test_unknown_point_and_variant_are_errors():
    with pytest.raises(KeyError, match="unknown fusion point 'nope'"):
        variants("nope")
    with pytest.raises(KeyError, match="no variant 'nope' for fusion point 'route'.*torch"):
        get("route", "nope")
    with pytest.raises(KeyError, match="unknown fusion points"):
        bind({"nope": "torch"})
    with pytest.raises(KeyError):
        bind({"route": "nope"})


def test_missing_backend_is_skipped_with_its_reason(monkeypatch, temporary):
    monkeypatch.setitem(registry._BACKEND_MODULES, "flashinfer", "no_such_module_for_tests")
    v = temporary(Variant("attn_out", "fi", "flashinfer", _ref_fn("attn_out")))
    assert "no_such_module_for_tests" in v.unsupported()
    with pytest.raises(RuntimeError, match="cannot use attn_out:fi"):
        bind({"attn_out": "fi"})


def test_gpu_backend_on_a_cpu_run_is_skipped(monkeypatch):
    monkeypatch.setattr(registry, "_cuda_available", lambda: True)  # as on a GPU host running --device cpu
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    v = Variant("attn_out", "cute_x", "cute", _ref_fn("attn_out"))
    monkeypatch.setitem(registry._BACKEND_MODULES, "cute", "json")  # "installed"
    assert "CUDA" in v.unsupported(device="cpu")
    assert v.unsupported(device="cuda") is None


def test_supports_reason_and_false():
    wl = Workload(batch=64)
    says_why = Variant("attn_out", "small", "torch", _ref_fn("attn_out"),
                       supports=lambda w: True if w.batch <= 8 else "batch > 8 needs the split-K kernel")
    says_no = Variant("attn_out", "never", "torch", _ref_fn("attn_out"), supports=lambda w: False)
    assert says_why.unsupported(Workload(batch=8)) is None
    assert says_why.unsupported(wl) == "batch > 8 needs the split-K kernel"
    assert "does not support" in says_no.unsupported(wl)


def _check_json(capsys, *argv):
    code = main(["check", *argv, "--json", "--batch", "1", "--prefill", "0", "0", "0", "--seeds", "1",
                 "--no-capture"])
    return code, json.loads(capsys.readouterr().out)


def test_check_skips_with_reasons_and_passes(capsys, temporary, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as in CI's `workbench check --device cpu`
    monkeypatch.setitem(registry._BACKEND_MODULES, "flashinfer", "no_such_module_for_tests")
    temporary(Variant("attn_out", "fi", "flashinfer", _ref_fn("attn_out")))
    temporary(Variant("attn_out", "b8", "torch", _ref_fn("attn_out"), supports=lambda w: w.batch >= 8 or "b >= 8 only"))
    code, out = _check_json(capsys, "attn_out")
    rows = {r["variant"]: r for r in out["results"]}
    assert code == 0 and out["passed"]
    assert rows["torch"]["status"] == "pass" and rows["torch"]["report"]["passed"]
    assert rows["fi"]["status"] == "skip" and "no_such_module_for_tests" in rows["fi"]["reason"]
    assert rows["b8"]["status"] == "skip" and rows["b8"]["reason"] == "b >= 8 only"
    assert all(r["status"] == "skip" for r in out["results"] if r["backend"] == "triton")


def test_check_fails_on_a_bad_variant(capsys, temporary):
    bad = planted("wrong_dtype")
    temporary(bad)
    code, out = _check_json(capsys, f"attn_out:{bad.name}")
    assert code == 1 and not out["passed"]
    (row,) = out["results"]
    assert row["status"] == "fail"
    assert "signature" in {c["name"] for c in row["report"]["checks"] if not c["passed"]}


def test_check_targets():
    assert {v.point for v in check.targets("torch_compile")} == set(registry.POINTS)
    assert [v.qualname for v in check.targets("route:torch")] == ["route:torch"]
    with pytest.raises(KeyError, match="neither a fusion point"):
        check.targets("nope")
    assert main(["check", "nope"]) == 2


def test_verify_blocks_keep_pdl_except_where_a_kernel_reads_the_kv_cache():
    """A verify block's rows are decode rows of one sequence, whose keys the step writes: PDL goes off at the
    point that reads the KV cache (attention, and the compound holding it) and stays on everywhere else."""
    configs = {"boundary": {"num_warps": 4, "pdl": True}, "qk_prep": {"num_warps": 8, "pdl": True},
               "attention": {"BLOCK_N": 64, "pdl": True}, "attention_out": {"gemv": {}, "pdl": True}, "head": None}
    assert registry.without_cache_pdl(configs) == {
        "boundary": {"num_warps": 4, "pdl": True}, "qk_prep": {"num_warps": 8, "pdl": True},
        "attention": {"BLOCK_N": 64}, "attention_out": {"gemv": {}}, "head": {}}
    assert [p for p in registry.POINTS if registry.reads_cache(p)] == ["attention", "attention_out"]
