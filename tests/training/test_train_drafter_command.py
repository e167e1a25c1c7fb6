"""`workbench train-drafter` end to end on the committed beam-mini, a few CPU steps: it writes the drafter
folder, its training record and one acceptance file per device; the card shows every measured device; new
weights drop the figures of the weights they replace."""

import json
import os

import pytest

from workbench.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINI = os.path.join(ROOT, "models", "beam-mini")
SMALL = ["--prompts", "2", "--max-tokens", "8", "--device", "cpu"]

pytestmark = pytest.mark.skipif(not os.path.isdir(MINI), reason="no committed beam-mini")


def test_train_then_measure_writes_the_folder_and_its_card(tmp_path):
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "acceptance-cuda.json").write_text("{}")  # figures of weights about to be replaced
    assert main(["train-drafter", str(out), "--target", MINI, "--steps", "2", "--batch", "2", "--seq-len", "64",
                 "--anchors", "2", *SMALL]) == 0
    assert sorted(os.listdir(out)) == ["README.md", "acceptance-cpu.json", "config.json", "model.safetensors",
                                       "training.json"]
    cpu = json.loads((out / "acceptance-cpu.json").read_text())
    assert cpu["prompts"] == 2 and set(cpu["modes"]) == {"greedy", "temperature_1_top_p_0.95"}
    assert json.loads((out / "training.json").read_text())["options"]["steps"] == 2
    # a GPU's figures beside the CPU's: the card shows both, each with its command
    (out / "acceptance-cuda.json").write_text(json.dumps(dict(cpu, device="cuda (a GPU)", cuda_graphs=True)))
    assert main(["train-drafter", str(out), "--target", MINI, "--measure", *SMALL]) == 0
    card = (out / "README.md").read_text()
    assert "### cpu" in card and "### cuda (a GPU)" in card and "CUDA graphs" in card
    assert card.count("Measured with:") == 2 and "--measure" in card
    # fewer drafts than the block's: a file of their own beside the others
    assert main(["train-drafter", str(out), "--target", MINI, "--measure", *SMALL,
                 "--num-speculative-tokens", "2"]) == 0
    assert json.loads((out / "acceptance-cpu-k2.json").read_text())["num_speculative_tokens"] == 2
    card = (out / "README.md").read_text()
    assert card.count("Measured with:") == 3 and ", 2 drafts a verify step," in card


def test_a_training_out_of_time_keeps_its_state_and_resumes(tmp_path, capsys):
    """`--max-seconds` stops between steps, keeps the state and exits 3 (no drafter written); the same
    command with `--resume` ends the training, writes the drafter and drops the state; `--resume` with
    nothing to go on from, or a file that is not a state, says so."""
    out = tmp_path / "drafter"
    train = ["train-drafter", str(out), "--target", MINI, "--layers", "1", "--steps", "3", "--batch", "2",
             "--seq-len", "64", "--anchors", "2", *SMALL, "--prompts", "1", "--max-tokens", "2"]
    assert main([*train, "--resume"]) == 2
    assert "no unfinished training to go on from" in capsys.readouterr().err.replace("\n", "")
    out.mkdir()
    (out / "training-state.pt").write_bytes(b"not a state")
    assert main([*train, "--resume"]) == 2
    assert "training-state.pt is not a training state this command wrote" in capsys.readouterr().err.replace("\n", "")
    assert main([*train, "--max-seconds", "0"]) == 3
    assert sorted(os.listdir(out)) == ["training-state.pt"]
    assert main([*train, "--resume"]) == 0
    assert "training-state.pt" not in os.listdir(out) and "model.safetensors" in os.listdir(out)
    assert [h[0] for h in json.loads((out / "training.json").read_text())["history"]] == [1, 2, 3]


def test_each_engine_and_the_drafter_run_the_build_they_are_given():
    """A verify lock for the engines with the drafter, a decode lock for the one without (a model of its
    own: a model binds one build), a draft lock for the drafter; the card says which ran where."""
    from types import SimpleNamespace

    from server.engine.acceptance import measure_acceptance
    from workbench.commands.train_drafter import acceptance_table

    def lock(**selection):
        return SimpleNamespace(selection=selection, configs=None)

    figures = measure_acceptance(MINI, os.path.join(ROOT, "models", "beam-mini-drafter"), prompts=1, prompt_tokens=16,
                                 max_tokens=6,
                                 lock=lock(qkvg_proj="packed"), plain_lock=lock(qkvg_proj="packed_views"),
                                 draft_lock=lock(qkvg_proj="packed_views"))
    assert figures["selection"]["qkvg_proj"] == "packed" and figures["plain_selection"]["qkvg_proj"] == "packed_views"
    assert figures["drafter_selection"]["qkvg_proj"] == "packed_views"
    assert figures["modes"]["greedy"]["fixed"]["equal_to_plain"] == "1/1"
    for ms in (figures["modes"]["greedy"]["step_ms_plain"], figures["modes"]["greedy"]["fixed"]["step_ms"]):
        assert 0 < ms["before_launch"] < ms["wall"] and ms["device"] is None  # no device timer on the CPU
    text = "\n".join(acceptance_table({**figures, "device": "cpu", "command": "c", "lock": "v.yaml",
                                       "plain_lock": "d.yaml", "draft_lock": None}))
    assert ("the target on the variants of `v.yaml` with the drafter, on the variants of `d.yaml` without it, "
            "the drafter on the variants of `v.yaml`") in text
    assert text.startswith("### cpu, locked kernels")
    wall = figures["modes"]["greedy"]["fixed"]["step_ms"]["wall"]
    assert "| greedy | fixed | " in text and f"| {wall:.3f}, " in text
    greedy = figures["modes"]["greedy"]
    assert 0 < greedy["decode_seconds_plain"] < greedy["seconds_plain"]
    assert 0 < greedy["fixed"]["decode_seconds"] < greedy["fixed"]["seconds"]
    assert f"| {greedy['fixed']['decode_tokens_per_second']:.1f} | {greedy['fixed']['decode_speedup']:.2f}x |" in text
    # a request's time by step kind: its prompt's prefill, then decode steps (verify steps with the drafter)
    assert set(greedy["steps_by_kind_plain"]) == {"prefill", "decode"} and greedy["fixed"]["fused_steps"] == 0
    assert greedy["steps_by_kind_plain"]["decode"]["steps"] == 5  # 6 tokens: the first from the prefill
    assert "verify" in greedy["fixed"]["steps_by_kind"]


def test_a_request_served_alone_is_timed_from_its_first_token_to_its_last(monkeypatch):
    """Decode seconds start at the step that gives the first token (a prefill step that gives none, a
    chunk of a long prompt, counts toward the whole request only)."""
    from types import SimpleNamespace

    from server.engine import acceptance

    clock = iter(range(100))
    monkeypatch.setattr(acceptance.time, "perf_counter", lambda: float(next(clock)))

    class Engine:
        def add_request(self, request_id, prompt, params):
            self.left = [[], [7], [8, 9], [10]]  # a prompt chunk, the first token, a verify step's two, the last

        def has_unfinished(self):
            return bool(self.left)

        def step(self):
            return [SimpleNamespace(token_ids=self.left.pop(0), error=None)]

    ids, total, decode = acceptance.serve_alone(Engine(), "r", [1, 2], None)
    # the clock reads 0 at arrival, 1 after the step of the first token, 2 at the end
    assert ids == [7, 8, 9, 10] and (total, decode) == (2.0, 1.0)


def test_a_lock_that_fails_verification_is_refused_unless_forced_and_then_named(tmp_path, capsys):
    """--lock verifies the lock before training (nothing is trained or written when it fails); --force-lock
    measures with it anyway and the acceptance file and the card say what it was forced past."""
    from beam_model.model import BeamForCausalLM
    from workbench.lock import Lock
    from workbench.provenance import environment
    from workbench.registry import POINTS

    config = BeamForCausalLM.from_pretrained(MINI, device="cpu").config
    path = str(tmp_path / "lock.yaml")
    Lock(model={"preset": config.preset, "config_hash": config.config_hash(), "dtype": "fp32"}, target="verify-b1",
         environment=environment(), points={p: Lock.entry(p, "torch") for p in POINTS}).save(path)
    text = open(path).read()
    open(path, "w").write(text.replace("created: ''", "created: edited"))
    out = tmp_path / "drafter"
    train = ["train-drafter", str(out), "--target", MINI, "--layers", "1", "--steps", "1", "--batch", "2",
             "--seq-len", "64", "--anchors", "2", *SMALL, "--prompts", "1", "--max-tokens", "2", "--lock", path]
    assert main(train) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "failed verification" in err and "training" not in err and not out.exists()
    assert main([*train, "--force-lock"]) == 0
    figures = json.loads((out / "acceptance-cpu-locked.json").read_text())
    assert list(figures["forced_past"]) == [path] and "digest mismatch" in figures["forced_past"][path][0]
    assert "was used past failed verification" in (out / "README.md").read_text()


def test_figures_from_two_kinds_of_gpu_get_files_of_their_own(monkeypatch):
    import torch

    from workbench.commands.train_drafter import device_kind

    assert device_kind("cpu") == "cpu"
    for name, kind in (("NVIDIA H200", "cuda-h200"), ("NVIDIA H100 80GB HBM3", "cuda-h100"),
                       ("AMD Instinct MI300X", "cuda-amd-instinct-mi300x")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert device_kind("cuda") == kind
