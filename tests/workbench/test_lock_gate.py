"""`workbench lock gate LOCK --model DIR`: a lock's build through the model gate on another model, the
trained beam-mini on held-out text, whose prompts reach past the sliding window where the gate's short
random prompts do not."""

import json

import pytest
from planted import planted

from workbench import registry
from workbench.cli import main
from workbench.commands.common import embedded_model
from workbench.lock import Lock
from workbench.registry import POINTS

pytestmark = pytest.mark.skipif(embedded_model() is None, reason="the embedded beam-mini is absent")


def _lock(tmp_path, dtype="bf16", **chosen) -> str:
    points = {p: {"variant": chosen.get(p, "torch")} for p in POINTS}
    path = str(tmp_path / "lock.yaml")
    Lock(model={"preset": "beam-mini", "dtype": dtype}, target="decode-b1", environment={}, points=points).save(path)
    return path


def _gate(capsys, *argv) -> tuple[int, dict]:
    rc = main(["lock", "gate", *argv, "--device", "cpu", "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_a_build_on_the_trained_model_is_gated_on_held_out_text(tmp_path, capsys):
    lock = _lock(tmp_path, qkvg_proj="packed_views", route="unsorted")
    rc, out = _gate(capsys, lock, "--model", embedded_model())
    assert rc == 0 and out["passed"], out["report"]
    case = out["report"]["checks"][0]["case"]
    assert "held-out text prompts 256,170 decode8" in case
    assert {c["name"] for c in out["report"]["checks"]} >= {"prompt_logits", "routing", "greedy_tokens"}


def test_a_fault_past_the_window_fails_on_the_text_prompts(tmp_path, capsys):
    """The gate's random prompts (24 tokens) stay inside beam-mini's 128-token window, so an attention
    that keeps one key too many passes them; the text prompts cross the window and fail it (in FP32,
    where the gate's tolerance is tight enough to see one key's weight)."""
    variant = planted("window_off_by_one")
    registry.variants("attention")[variant.name] = variant
    try:
        lock = _lock(tmp_path, dtype="fp32", attention=variant.name)
        rc, random_ids = _gate(capsys, lock)  # the lock's preset: random weights, random ids
        assert rc == 0 and random_ids["model"] == "preset beam-mini (random weights)"
        rc, text = _gate(capsys, lock, "--model", embedded_model())
    finally:
        del registry.variants("attention")[variant.name]
    assert rc == 1 and not text["passed"]
    failed = {c["name"] for c in text["report"]["checks"] if not c["passed"]}
    assert "prompt_logits" in failed, text["report"]


def test_a_renamed_variant_runs_under_its_name_now_and_says_so(tmp_path, capsys):
    lock = _lock(tmp_path, route="cublas")
    rc, out = _gate(capsys, lock, "--model", "beam-tiny")
    assert "route:cublas is registered as route:triton_cublas now" in out["notes"]
    assert "route:triton_cublas" in out["report"]["subject"]
    with pytest.raises(KeyError, match="now registered as 'triton_cublas'"):
        registry.get("route", "cublas")


def test_a_model_that_is_neither_a_folder_nor_a_preset_is_named(tmp_path, capsys):
    rc = main(["lock", "gate", _lock(tmp_path), "--model", "no-such-model", "--device", "cpu"])
    assert rc != 0 and "no-such-model" in capsys.readouterr().err
