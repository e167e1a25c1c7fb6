"""`workbench lock compare`: several locks' builds of one target timed in one process, in rounds of
alternating order, each lock's model built and freed in turn."""

import json

import pytest

from beam_model.config import BeamConfig
from workbench.cli import main
from workbench.lock import Lock
from workbench.lock_compare import compare_locks
from workbench.provenance import environment
from workbench.registry import POINTS


def _lock(tmp_path, name, target="decode-b1", weights="bf16", **chosen) -> str:
    points = {p: Lock.entry(p, chosen.get(p, "torch")) for p in POINTS}
    path = str(tmp_path / f"{name}.yaml")
    model = {"preset": "beam-tiny", "config_hash": BeamConfig.from_preset("beam-tiny").config_hash(), "dtype": "fp32",
             "weights": weights}
    Lock(model=model, target=target,
         environment=environment(), points=points).save(path)
    return path


def test_each_lock_is_timed_every_round_in_alternating_order(tmp_path):
    a, b = _lock(tmp_path, "a"), _lock(tmp_path, "b", weights="fp8", route="unsorted")
    order = []
    result = compare_locks([a, b], rounds=2, budget_s=0.01, device="cpu",
                           on_timed=lambda path, r, us: order.append((r, path)))
    assert order == [(0, a), (0, b), (1, b), (1, a)]
    first, second = result["locks"]
    assert result["target"] == "decode-b1" and first["lock"] == a and second["weights"] == "fp8"
    assert len(first["round_us"]) == 2 and all(us > 0 for us in first["round_us"] + second["round_us"])
    assert first["over_first"] == 1.0 and second["over_first"] == second["median_us"] / first["median_us"]


def test_locks_of_different_targets_or_failing_verification_are_refused(tmp_path):
    a, prefill = _lock(tmp_path, "a"), _lock(tmp_path, "p", target="prefill-8x2k")
    with pytest.raises(ValueError, match="different targets.*decode-b1.*prefill-8x2k"):
        compare_locks([a, prefill], budget_s=0.01, device="cpu")
    tampered = _lock(tmp_path, "t")
    text = open(tampered).read()
    open(tampered, "w").write(text.replace("target: decode-b1", "target: decode-b8"))
    with pytest.raises(ValueError, match="failed verification"):
        compare_locks([a, tampered], budget_s=0.01, device="cpu")
    # forced, a lock edited after it was written is timed and its row says what it was forced past; the sound
    # one's says nothing
    edited = _lock(tmp_path, "e")
    text = open(edited).read()
    open(edited, "w").write(text.replace("created: ''", "created: edited"))
    result = compare_locks([a, edited], rounds=1, budget_s=0.01, device="cpu", force=True)
    sound, forced = result["locks"]
    assert sound["forced_past"] == [] and any("digest mismatch" in p for p in forced["forced_past"])


def test_the_command_writes_compare_json_and_wants_two_locks(tmp_path, capsys):
    a, b = _lock(tmp_path, "a"), _lock(tmp_path, "b", route="unsorted")
    out = tmp_path / "out"
    assert main(["lock", "compare", a, b, "--rounds", "1", "--budget", "0.01", "--device", "cpu",
                 "--out", str(out), "--json"]) == 0
    result = json.loads((out / "compare.json").read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert [row["lock"] for row in result["locks"]] == [a, b] and result["command"].startswith("workbench lock")
    assert main(["lock", "compare", a, "--device", "cpu"]) != 0
    assert "two or more lock files" in capsys.readouterr().err
    assert main(["lock", "show", a, b]) != 0
    assert "lock show takes one lock file, got 2" in capsys.readouterr().err
