"""The pieces of the serving sweep (scripts/gpu_serve_sweep.sh): the Hugging Face export of the
byte-level tokenizer, the engine's step-time metric (beam_engine_step_seconds) and the sweep's
reading of it; and, where SGLang's benchmark client is installed, the whole sweep on beam-tiny.
"""

import importlib.util
import json
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from beam_model.model import BeamForCausalLM
from beam_model.tokenizer import ByteTokenizer, HFTokenizer, save_hf_tokenizer
from server.api.metrics import Metrics
from server.api.structures import completion_structure
from server.engine import Engine, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import serve_sweep  # noqa: E402


def test_hf_export_encodes_and_decodes_like_the_byte_tokenizer(tmp_path):
    save_hf_tokenizer(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == "<|end|>"
    hf, byte = HFTokenizer(tmp_path / "tokenizer.json"), ByteTokenizer()
    assert hf.vocab_size == byte.vocab_size and hf.eos_token_id == byte.eos_token_id
    rng = random.Random(0)
    pieces = ["a", " ", "é", "漢", "\n", "<|end|>", "<|user|>", "😀", "\x00", "~", "Ā", "  x"]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 20)))
        for special in (True, False):
            assert hf.encode(text, allow_special=special) == byte.encode(text, allow_special=special), text
        assert hf.decode(byte.encode(text)) == text
    ids = [rng.randrange(byte.vocab_size) for _ in range(300)]  # invalid UTF-8 too
    assert hf.decode(ids) == byte.decode(ids)


def test_step_metric_is_read_back_per_kind_and_rounded_batch():
    fake = SimpleNamespace(engine=SimpleNamespace(step_observer=None), stats=lambda: {
        "running": 0, "waiting": 0, "pages_used": {}, "pages_cached": {}, "pages_total": {},
        "prefix_queried_tokens": 0, "prefix_hit_tokens": 0, "preemptions": 0})
    m = Metrics(fake)
    assert fake.engine.step_observer == m.observe_step
    before = serve_sweep.parse_metrics(m.render().decode())
    for seconds in (0.004, 0.004, 0.009):
        fake.engine.step_observer("decode", 3, seconds, 0.0003, 0.0035)
    fake.engine.step_observer("prefill", 1, 0.02, 0.001, None)  # a CPU step: no device time
    fake.engine.step_observer("decode", 300, 0.05, 0.002)
    fake.engine.step_observer("decode", 64, 0.01, 0.001, 0.008, 0.0021)  # rows under a grammar
    after = serve_sweep.parse_metrics(m.render().decode())
    rows = {(r["kind"], r["batch"]): r for r in serve_sweep.step_times(before, after)}
    assert set(rows) == {("decode", 4), ("prefill", 1), ("decode", 256), ("decode", 64)}
    assert rows["decode", 4]["steps"] == 3 and rows["decode", 4]["mean_ms"] == pytest.approx(17 / 3)
    assert rows["decode", 4]["p50_ms_upper_bucket"] == pytest.approx(4.0)
    assert rows["decode", 4]["prepare_mean_ms"] == pytest.approx(0.3)
    assert rows["prefill", 1]["prepare_mean_ms"] == pytest.approx(1.0)
    assert rows["decode", 4]["device_mean_ms"] == pytest.approx(3.5) and rows["prefill", 1]["device_mean_ms"] is None
    assert rows["decode", 64]["grammar_mean_ms"] == pytest.approx(2.1) and rows["decode", 4]["grammar_mean_ms"] is None


def test_engine_reports_each_model_step_to_its_observer():
    torch.set_num_threads(1)
    model = BeamForCausalLM.from_preset("beam-tiny", dtype=torch.float32, seed=0)
    engine = Engine(model, ByteTokenizer(), num_pages=32, max_num_batched_tokens=64)
    seen = []
    engine.step_observer = lambda kind, n, seconds, prepare, device, grammar: \
        seen.append((kind, n, seconds, prepare, device, grammar))
    engine.generate([list(range(10, 15)), list(range(5, 105))], SamplingParams(max_tokens=4, temperature=0.0))
    kinds = [k for k, *_ in seen]
    assert len(seen) == engine.num_steps and all(0 < prepare < s for *_, s, prepare, _, _ in seen)
    assert all(device is None and grammar is None for *_, device, grammar in seen)  # CUDA events; no grammar
    # 5 + 100 prompt tokens under a 64-token budget: both prompts start (prefill), the short one's
    # decode rides along the long one's second chunk (mixed), then both decode
    assert kinds[:2] == ["prefill", "mixed"] and kinds[-1] == "decode"
    assert {n for k, n, *_ in seen if k == "decode"} <= {1, 2}
    seen.clear()  # a request under a grammar: its steps report the host time of their masks
    engine.generate([list(range(10, 15))], SamplingParams(max_tokens=4, temperature=0.0,
                                                          structure=completion_structure({"type": "object"})))
    assert seen and all(grammar is not None and 0 < grammar < s for _, _, s, _, _, grammar in seen)


def test_each_level_gets_prompts_no_other_level_has(tmp_path):
    serve_sweep.write_dataset(tmp_path / "a.json", 6, 40, seed=0)
    serve_sweep.write_dataset(tmp_path / "b.json", 6, 40, seed=0, first=6)
    texts = [c["conversations"][0]["value"] for f in ("a.json", "b.json")
             for c in json.loads((tmp_path / f).read_text())]
    assert len({t[:16] for t in texts}) == 12 and all(len(t) >= 40 for t in texts)


CLIENT = all(importlib.util.find_spec(m) for m in ("sglang", "transformers", "aiohttp", "requests"))


@pytest.mark.skipif(not CLIENT,
                    reason="SGLang's bench_serving client is not installed (see scripts/gpu_serve_sweep.sh)")
def test_quick_sweep_end_to_end(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "scripts/serve_sweep.py", "--preset", "beam-tiny", "--quick", "--levels", "1", "2",
           "--num-prompts", "2", "4", "--server-args=--num-pages 64 --dtype fp32 --device cpu"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "serve-sweep" / "sweep.json").read_text())
    assert [lv["concurrency"] for lv in doc["levels"]] == [1, 2]
    for lv in doc["levels"]:
        assert lv["errors"] == 0 and lv["completed"] == lv["requests"]
        assert lv["server"]["prefix_hit_tokens"] == 0
        assert lv["total_output_tokens"] == 16 * lv["requests"]
        assert lv["ttft_p50_ms"] > 0 and lv["per_user_decode_tok_s_p50"] > 0 and lv["output_tok_s"] > 0
        assert any(s["kind"] == "decode" for s in lv["server"]["step_times"])
    # no level reuses another's prompts, nor sends one twice (the client's warm-up would): beam-tiny's
    # 16-token window under 64-token pages never gives a prefix hit, so the commands are what is checked
    datasets = [lv["command"].split("--dataset-path ")[1].split()[0] for lv in doc["levels"]]
    assert len(set(datasets)) == 2 and all("--warmup-requests 0" in lv["command"] for lv in doc["levels"])
    assert "| 2 |" in (tmp_path / "serve-sweep" / "report.md").read_text()
