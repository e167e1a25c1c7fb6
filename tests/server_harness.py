"""Test helpers for the server tests: start a REAL `workbench serve` process on a free port, read
its Prometheus metrics, and the scripted replies (server/engine/testing.py) the tests rely on.

Each server test module starts one server for the whole module (fixture scope "module"). The
server runs beam-tiny in FP32 on the CPU with one intra-op thread (fast and deterministic).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "beam-tiny"
API_KEY = "test-key-123"

# Scripted replies: the first rule whose `when` is in the rendered prompt forces `reply` (+ <|end|>).
SCRIPT = [
    # Second turn of the reasoning round trip: matches only if the template re-rendered the reasoning.
    {"when": "<|assistant|><|think|>I think deeply.<|/think|>The answer is 42.<|end|>", "reply": "ROUNDTRIP_OK"},
    {"when": "SCRIPT_REASON", "reply": "<|think|>I think deeply.<|/think|>The answer is 42."},
    {"when": "SCRIPT_TOOL", "reply": '<|think|>Need weather.<|/think|><|tool_call|>{"name": "get_weather", '
                                     '"arguments": {"city": "Paris"}}<|/tool_call|>'},
    # Forced calls are decoded under the template's grammar: the reply is a whole turn that follows it
    {"when": "SCRIPT_FORCED_NAMED", "reply": '<|think|><|/think|><|tool_call|>{"name": "get_weather", '
                                             '"arguments": {"city": "Rome"}}<|/tool_call|>'},
    {"when": "SCRIPT_FORCED_REQ", "reply": '<|think|>Time.<|/think|><|tool_call|>{"name": "get_time", '
                                           '"arguments": {"tz": "UTC"}}<|/tool_call|>'},
    {"when": "SCRIPT_BAD_TOOL", "reply": '<|think|><|/think|><|tool_call|>{"name": broken<|/tool_call|>'},
    {"when": "SCRIPT_FAIL", "reply": "partial output", "fail_at": 6},
]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *extra: str, api_key: str | None = API_KEY, num_pages: int = 512,
                 model: tuple[str, ...] = ("--preset", MODEL), scripted: bool = True, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self._dir = tempfile.TemporaryDirectory()
        script = os.path.join(self._dir.name, "script.json")
        with open(script, "w") as f:
            json.dump(SCRIPT, f)
        self.log_path = os.path.join(self._dir.name, "server.log")
        cmd = [sys.executable, "-m", "workbench.cli", "serve", *model, "--device", "cpu",
               "--dtype", "fp32", "--port", str(self.port), "--num-pages", str(num_pages),
               "--log-level", "warning", *extra]
        if scripted:
            cmd += ["--fake-model-script", script]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **(env or {})}
        env.pop("BEAM_API_KEY", None)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def metrics(self) -> dict:
        """Flat {name or name{labels}: value} from /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
                                if s.labels else "")
                out[key] = s.value
        return out

    def engine_stats(self) -> dict:
        return httpx.get(self.url + "/debug/engine", headers=self.headers, timeout=10).json()

    def wait_idle(self, timeout: float = 10) -> dict:
        """Engine stats once nothing runs or waits and no page is referenced (or the last seen)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.engine_stats()
            idle = not s["running"] and not s["waiting"] and not any(s["pages_used"].values())
            if idle or time.monotonic() > deadline:
                return s
            time.sleep(0.05)

    def stop(self, sig=signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def metric_sum(metrics: dict, name: str) -> float:
    """Sum of a metric over all its label sets."""
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))
