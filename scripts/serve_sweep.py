"""Driver of scripts/gpu_serve_sweep.sh: a concurrency sweep of `workbench serve` with a standard
benchmarking client (SGLang's `bench_serving`, through scripts/bench_serving.py), plus the server's
own model-step times from its Prometheus metrics.

Starts `python3 -m workbench.cli serve --preset P [--lock FILE]` on 127.0.0.1, waits for /health,
sends one probe request (warm-up and a first latency estimate), then runs the client once per
concurrency level (default 1, 8, 32) on /v1/completions with streaming: fixed-length prompts of
`--input-len` tokens cut from a seeded ASCII text (so the byte-level tokenizer's count is exact),
`--output-len` tokens each with ignore_eos, as many prompts as fit about `--target-s` seconds at the
throughput seen so far. /metrics is scraped before and after every level; the difference gives the
server's own step times (beam_engine_step_seconds) for that level. Every level runs under a
timeout and the whole sweep under `--budget-s`. Then the server is stopped and the results written
(at most 5 files) to $OUT/serve-sweep/ when $OUT is set, else runs/serve-sweep-PRESET/.

Never edits sources; everything temporary lives in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
T0 = time.monotonic()
WORDS = ("the of and to in is was for on that with as by at from his her an are were which this be or had "
         "not but have it they one all their there been has more when will would who so no if out up into "
         "model token kernel cache page batch step decode prefill expert router layer weight tensor graph "
         "stream server client request latency window attention sliding norm residual logits sample").split()


def log(msg: str) -> None:
    print(f"[serve_sweep {time.strftime('%H:%M:%S')} +{time.monotonic() - T0:5.0f}s] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


# ---- Prometheus text -> {(name, labels): value} ------------------------------------------------
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$')


def parse_metrics(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def step_times(before: dict, after: dict) -> list[dict]:
    """beam_engine_step_seconds between two scrapes: per (kind, batch) count, mean and p50 (bucket),
    with the means of beam_engine_step_prepare_seconds (host time before the forward), on CUDA
    beam_engine_step_device_seconds (GPU time from the forward's launch to the drawn tokens) and, for
    steps with a grammar-constrained row, beam_engine_step_grammar_seconds (host time filling masks)."""
    rows = _histogram_rows(before, after, "beam_engine_step_seconds")
    for field, histogram in (("prepare_mean_ms", "beam_engine_step_prepare_seconds"),
                             ("device_mean_ms", "beam_engine_step_device_seconds"),
                             ("grammar_mean_ms", "beam_engine_step_grammar_seconds")):
        means = {(r["kind"], r["batch"]): r["mean_ms"] for r in _histogram_rows(before, after, histogram)}
        for r in rows:
            r[field] = means.get((r["kind"], r["batch"]))
    return rows


def _histogram_rows(before: dict, after: dict, histogram: str) -> list[dict]:
    rows = {}
    for (name, labels), v in after.items():
        if name not in (histogram + "_count", histogram + "_sum", histogram + "_bucket"):
            continue
        d = dict(labels)
        key = (d.get("kind"), d.get("batch"))
        delta = v - before.get((name, labels), 0.0)
        r = rows.setdefault(key, {"buckets": {}})
        if name.endswith("_count"):
            r["count"] = delta
        elif name.endswith("_sum"):
            r["sum"] = delta
        elif name.endswith("_bucket"):
            r["buckets"][float(d["le"])] = delta
    out = []
    for (kind, batch), r in sorted(rows.items(), key=lambda kv: (kv[0][0], int(kv[0][1]))):
        n = r.get("count", 0)
        if n <= 0:
            continue
        p50 = next((le for le, c in sorted(r["buckets"].items()) if c >= n / 2), None)
        out.append({"kind": kind, "batch": int(batch), "steps": int(n), "mean_ms": 1e3 * r.get("sum", 0) / n,
                    "p50_ms_upper_bucket": None if p50 in (None, math.inf) else 1e3 * p50})
    return out


def hist_mean_ms(before: dict, after: dict, name: str) -> float | None:
    n = after.get((name + "_count", ()), 0) - before.get((name + "_count", ()), 0)
    s = after.get((name + "_sum", ()), 0) - before.get((name + "_sum", ()), 0)
    return 1e3 * s / n if n > 0 else None


def counter_delta(before: dict, after: dict, name: str) -> float:
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == name)


# ---- inputs -------------------------------------------------------------------------------------
def write_dataset(path: Path, num: int, chars: int, seed: int, first: int = 0) -> None:
    """ShareGPT-format conversations of seeded random ASCII words, each at least `chars` long, so
    that `--dataset-name random` cuts exact-length prompts from them without downloading ShareGPT.
    Every prompt starts with its number (`first` on): no prefix-cache hits between them, nor with
    another file whose numbers do not overlap."""
    rng = random.Random(f"{seed}:{first}")
    convs = []
    for i in range(first, first + num):
        words, n = [f"[{i}]"], 0
        while n < chars + 16:
            w = rng.choice(WORDS)
            words.append(w)
            n += len(w) + 1
        convs.append({"id": str(i), "conversations": [{"from": "human", "value": " ".join(words)},
                                                      {"from": "gpt", "value": "ok"}]})
    path.write_text(json.dumps(convs))


def package_versions(names) -> dict:
    from importlib import metadata

    out = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    return out


# ---- the server ---------------------------------------------------------------------------------
class Server:
    def __init__(self, args, port: int, log_path: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [sys.executable, "-m", "workbench.cli", "serve", "--preset", args.preset, "--host", "127.0.0.1",
                    "--port", str(port), "--served-model-name", args.served_model_name, "--log-level", "warning",
                    *(["--lock", args.lock] if args.lock else []), *(["--force-lock"] if args.force_lock else []),
                    *(["--device", args.device] if args.device else []),
                    *shlex.split(args.server_args)]
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # its own group: stopped with everything it started

    def shown(self) -> str:
        return shlex.join(["python3", *self.cmd[1:]])

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}:\n{self.tail()}")
            try:
                if http(self.url + "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready after {timeout:.0f} s:\n{self.tail()}")

    def metrics(self) -> tuple[dict, str]:
        text = http(self.url + "/metrics", timeout=10)[1]
        return parse_metrics(text), text

    def tail(self, n: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # graceful: uvicorn drains, the engine thread stops
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything it left behind (compile workers)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()
        return self.proc.returncode


# ---- the client ---------------------------------------------------------------------------------
def client_cmd(args, url: str, tokenizer: Path, dataset: Path, concurrency: int, num_prompts: int,
               result: Path) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "bench_serving.py"), "--backend", "vllm", "--base-url", url,
            "--model", args.served_model_name, "--tokenizer", str(tokenizer), "--dataset-name", "random",
            "--dataset-path", str(dataset), "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", "1.0",
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--seed", str(args.seed), "--warmup-requests", "0", "--disable-tqdm", "--output-file", str(result)]


def run_level(args, cmd: list[str], result: Path, client_log, timeout: float) -> tuple[dict | None, str | None]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    client_log.write(f"\n$ {shlex.join(cmd)}\n")
    client_log.flush()
    proc = subprocess.Popen(cmd, cwd=result.parent, stdout=client_log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None, f"the client timed out after {timeout:.0f} s"
    if not result.exists() or not result.read_text().strip():
        return None, f"the client exited with code {proc.returncode} and wrote no result (see client.log)"
    return json.loads(result.read_text().strip().splitlines()[-1]), None


def summarize(res: dict, num_prompts: int) -> dict:
    tpot = res.get("median_tpot_ms")
    return {
        "requests": num_prompts, "completed": res.get("completed"),
        "errors": num_prompts - (res.get("completed") or 0),
        "duration_s": res.get("duration"),
        "ttft_p50_ms": res.get("median_ttft_ms"), "ttft_p99_ms": res.get("p99_ttft_ms"),
        "ttft_mean_ms": res.get("mean_ttft_ms"),
        "tpot_p50_ms": tpot, "tpot_p99_ms": res.get("p99_tpot_ms"),
        "per_user_decode_tok_s_p50": 1e3 / tpot if tpot else None,
        "itl_p50_ms": res.get("median_itl_ms"), "itl_p99_ms": res.get("p99_itl_ms"),
        "e2e_p50_ms": res.get("median_e2e_latency_ms"),
        "output_tok_s": res.get("output_throughput"), "total_tok_s": res.get("total_throughput"),
        "request_rate_s": res.get("request_throughput"),
        "total_input_tokens": res.get("total_input_tokens"), "total_output_tokens": res.get("total_output_tokens"),
        "total_output_tokens_retokenized": res.get("total_output_tokens_retokenized"),
        "max_concurrent_requests": res.get("max_concurrent_requests"),
    }


# ---- main ---------------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="beam-small")
    p.add_argument("--lock", metavar="FILE", help="serve this lock's variants (default: the reference)")
    p.add_argument("--device", help="passed to `workbench serve --device` (default: cuda when available)")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32], help="concurrency levels (default: 1 8 32)")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=256, help="generated tokens per request (default: %(default)s)")
    p.add_argument("--target-s", type=float, default=45, help="aimed duration of one level (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, nargs="+",
                   help="prompts per level, one number per level (default: sized from --target-s)")
    p.add_argument("--min-rounds", type=int, default=2, help="prompts >= this many x the concurrency (default: 2)")
    p.add_argument("--level-timeout-s", type=float, default=150, help="hard limit of one level (default: %(default)s)")
    p.add_argument("--startup-timeout-s", type=float, default=240, help="server start limit (default: %(default)s)")
    p.add_argument("--budget-s", type=float, default=340,
                   help="deadline of the whole sweep, server start included (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: input 32, output 16, levels 1 4, about 4 s per level")
    p.add_argument("--force-lock", action="store_true", help="serve the lock even if it fails verification")
    p.add_argument("--server-args", default="",
                   help="more `workbench serve` arguments as one string, written --server-args='--max-num-seqs 32'")
    p.add_argument("--served-model-name", default=None, help="default: the preset")
    p.add_argument("--optimize-report", metavar="FILE",
                   help="a `workbench optimize` report.json to compare step times with (default: report.json "
                        "beside --lock, if there)")
    p.add_argument("--name", help="output folder name (default: serve-sweep under $OUT, else serve-sweep-PRESET)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.input_len, args.output_len, args.target_s = 32, 16, 4
        if "--levels" not in sys.argv:
            args.levels = [1, 4]
    if args.num_prompts and len(args.num_prompts) != len(args.levels):
        p.error("--num-prompts needs one number per level")
    args.served_model_name = args.served_model_name or args.preset
    deadline = T0 + args.budget_s

    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / (args.name or "serve-sweep")
    else:
        out = ROOT / "runs" / (args.name or ("serve-sweep-quick-" if args.quick else "serve-sweep-") + args.preset)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="serve-sweep-"))
    log(f"output {out}; temporary files {tmp}")

    from beam_model.tokenizer import save_hf_tokenizer

    tokenizer = save_hf_tokenizer(tmp / "tokenizer")
    most = max(args.num_prompts or [0]) or 4000
    log(f"byte-level tokenizer exported to {tokenizer}; up to {most + 64} ASCII prompts a level under {tmp}")

    server = Server(args, free_port(), out / "server.log")
    log(f"starting: {server.shown()}")
    client_log = open(out / "client.log", "w")
    levels, probe, metrics_text, error = [], None, "", None
    try:
        server.wait_ready(min(args.startup_timeout_s, deadline - time.monotonic() - 30))
        log("server ready")
        # probe: one request of the benchmark's shape (warms up; first throughput estimate)
        body = {"model": args.served_model_name, "prompt": "x" * args.input_len, "max_tokens": args.output_len,
                "temperature": 0.0, "ignore_eos": True}
        t = time.monotonic()
        status, text = http(server.url + "/v1/completions", body, timeout=min(120, deadline - time.monotonic()))
        probe = {"seconds": time.monotonic() - t, "status": status}
        if status != 200:
            raise RuntimeError(f"the probe request failed with HTTP {status}: {text[:500]}")
        log(f"probe: one request {args.input_len} in / {args.output_len} out took {probe['seconds']:.2f} s")
        rate, rate_c = 1.0 / probe["seconds"], 1  # requests/s measured at concurrency rate_c
        for i, c in enumerate(args.levels):
            left = deadline - time.monotonic() - 20  # kept for stopping the server and writing results
            if left < 15:
                log(f"concurrency {c}: skipped, the time budget is spent")
                levels.append({"concurrency": c, "error": "skipped: time budget spent"})
                continue
            target = min(args.target_s, max(5.0, left / (len(args.levels) - i) - 12))  # ~12 s client start
            if args.num_prompts:
                n = args.num_prompts[i]
            else:
                est = rate * math.sqrt(c / rate_c) if c > rate_c else rate * c / rate_c
                n = min(max(args.min_rounds * c, round(target * est)), most)
            result = tmp / f"level-{c}.jsonl"
            # each level its own prompts: the client draws a file's prompts in the same seeded order, so a
            # shared file let a level hit the pages the levels before it cached. No client warm-up either
            # (the probe warmed the server): it sends the level's first prompt ahead of the level.
            dataset = tmp / f"prompts-{c}.json"
            write_dataset(dataset, n + 64, args.input_len, args.seed, first=(i + 1) * (most + 64))
            cmd = client_cmd(args, server.url, tokenizer, dataset, c, n, result)
            before, _ = server.metrics()
            timeout = min(args.level_timeout_s, left)
            log(f"concurrency {c}: {n} prompts (aiming at {target:.0f} s, timeout {timeout:.0f} s)")
            started = time.monotonic()
            res, err = run_level(args, cmd, result, client_log, timeout)
            after, metrics_text = server.metrics()
            row = {"concurrency": c, "num_prompts": n, "wall_s": time.monotonic() - started,
                   "command": shlex.join(["python3", *cmd[1:]]), "error": err}
            if res is not None:
                row.update(summarize(res, n))
                if res.get("request_throughput"):
                    rate, rate_c = res["request_throughput"], c
            row["server"] = {
                "step_times": step_times(before, after),
                "ttft_mean_ms": hist_mean_ms(before, after, "beam_time_to_first_token_seconds"),
                "itl_mean_ms": hist_mean_ms(before, after, "beam_inter_token_latency_seconds"),
                "requests": counter_delta(before, after, "beam_requests_total"),
                "generation_tokens": counter_delta(before, after, "beam_generation_tokens_total"),
                "rejected": counter_delta(before, after, "beam_requests_rejected_total"),
                "preemptions": counter_delta(before, after, "beam_preemptions_total"),
                "prefix_hit_tokens": counter_delta(before, after, "beam_prefix_cache_hit_tokens_total"),
            }
            levels.append(row)
            if err:
                log(f"concurrency {c}: {err}")
            else:
                dec = [s for s in row["server"]["step_times"] if s["kind"] == "decode"]
                top = max(dec, key=lambda s: s["steps"]) if dec else None
                log(f"concurrency {c}: {row['completed']}/{n} ok in {row['duration_s']:.1f} s; TTFT p50 "
                    f"{row['ttft_p50_ms']:.1f} ms p99 {row['ttft_p99_ms']:.1f} ms; "
                    f"TPOT p50 {row['tpot_p50_ms']:.2f} ms "
                    f"({row['per_user_decode_tok_s_p50']:.1f} tok/s/user); output {row['output_tok_s']:.1f} tok/s"
                    + (f"; server decode step b{top['batch']} {top['mean_ms']:.2f} ms" if top else ""))
    except Exception as e:  # noqa: BLE001 - still stop the server and write what we have
        error = f"{type(e).__name__}: {e}"
        log(f"failed: {error}")
    finally:
        code = server.stop()
        client_log.close()
        log(f"server stopped (exit code {code})")

    write_results(args, out, server, levels, probe, error, metrics_text)
    log(f"wrote {out}/sweep.json and {out}/report.md")
    ok = error is None and levels and all(r.get("error") is None and r.get("errors") == 0 for r in levels)
    return 0 if ok else 1


def optimize_reference(args) -> dict | None:
    path = args.optimize_report or (str(Path(args.lock).with_name("report.json")) if args.lock else None)
    if not path or not Path(path).is_file():
        return None
    r = json.loads(Path(path).read_text())
    return {"file": path, "target": r.get("target"), "preset": r.get("preset"), "dtype": r.get("dtype"),
            "step": r.get("step"), "locked_ms": r.get("locked_ms"), "reference_ms": r.get("reference_ms"),
            "torch_compile_ms": r.get("torch_compile_ms"), "command": r.get("command")}


def write_results(args, out: Path, server: Server, levels, probe, error, metrics_text: str) -> None:
    try:
        from workbench.provenance import environment

        env = environment(args.device)
    except Exception as e:  # noqa: BLE001
        env = {"error": f"{type(e).__name__}: {e}"}
    env["packages"] = package_versions(["sglang", "transformers", "aiohttp", "fastapi", "starlette", "uvicorn",
                                        "pydantic", "prometheus-client", "numpy"])
    command = "bash scripts/gpu_serve_sweep.sh " + shlex.join(sys.argv[1:])
    opt = optimize_reference(args)
    doc = {"command": command.strip(), "server_command": server.shown(), "preset": args.preset, "lock": args.lock,
           "input_len": args.input_len, "output_len": args.output_len, "client": "sglang.bench_serving "
           "(backend vllm: /v1/completions, streamed, ignore_eos, temperature 0) via scripts/bench_serving.py",
           "probe": probe, "error": error, "levels": levels, "optimize": opt, "environment": env}
    (out / "sweep.json").write_text(json.dumps(doc, indent=2) + "\n")
    if metrics_text:
        (out / "metrics-last.txt").write_text(metrics_text)

    def f(v, fmt=".1f"):
        return "" if v is None else format(v, fmt)

    lines = [f"# Serving sweep: {args.preset}" + (f" with {args.lock}" if args.lock else " (reference variants)"), "",
             f"Command: `{command.strip()}`", "", f"Server: `{server.shown()}`", "",
             f"Client: SGLang `bench_serving` {env['packages'].get('sglang')} (unmodified, run through "
             "`scripts/bench_serving.py`), `--backend vllm` = OpenAI `/v1/completions`, streamed, ignore_eos, "
             f"temperature 0; {args.input_len} prompt tokens and {args.output_len} output tokens per request "
             "(`--dataset-name random --random-range-ratio 1` over seeded ASCII text: the byte-level tokenizer, "
             "exported as a Hugging Face folder, counts exactly); one request in flight per user "
             "(`--max-concurrency`, `--request-rate inf`). Each level's command is in sweep.json.", "",
             f"Environment: {env.get('gpu') or 'cpu'}, driver {env.get('driver')}, torch {env.get('torch')}, "
             f"python {env.get('python')}, commit {env.get('git_commit')}"
             + (" (dirty)" if env.get("git_dirty") else "")
             + (f", git tree {env['git_tree']}" if env.get("git_tree") else "")
             + f", {env.get('date')}; packages {json.dumps(env['packages'])}", ""]
    if error:
        lines += [f"**The sweep stopped early: {error}**", ""]
    lines += ["| users | requests | errors | TTFT p50 ms | TTFT p99 ms | server TTFT mean ms | TPOT p50 ms | "
              "per-user decode tok/s | output tok/s (all users) | ITL p50 ms | duration s | prefix-cache hit tokens |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in levels:
        if r.get("completed") is None:
            lines.append(f"| {r['concurrency']} | {r.get('num_prompts', '')} | {r.get('error')} | | | | | | | | | |")
            continue
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['errors']} | {f(r['ttft_p50_ms'])} | "
                     f"{f(r['ttft_p99_ms'])} | {f(r['server']['ttft_mean_ms'])} | {f(r['tpot_p50_ms'], '.2f')} | "
                     f"{f(r['per_user_decode_tok_s_p50'])} | "
                     f"{f(r['output_tok_s'])} | {f(r['itl_p50_ms'], '.2f')} | {f(r['duration_s'])} | "
                     f"{f(r['server'].get('prefix_hit_tokens'), '.0f')} |")
    lines += ["", "Per-user decode tok/s = 1000 / TPOT p50 (TPOT: a request's time after its first token divided "
              "by its other tokens). TTFT and ITL as the client saw them: the client counts a token when its "
              "streamed chunk carries text, and the byte-level tokenizer holds back the bytes of an unfinished "
              "UTF-8 character, so with random weights some chunks arrive empty: the client's TTFT includes "
              "about one extra decode step on average, and its ITL is per text chunk. 'server TTFT mean' is "
              "the server's own arrival-to-first-token time (beam_time_to_first_token_seconds, exact, mean "
              "only). TPOT and the throughputs count tokens (the requested output length, which ignore_eos "
              "guarantees), not chunks. Each level draws its own prompts (none shared with another level or "
              "the probe; the client's warm-up request, a copy of the first, is off), so its prefix-cache hits "
              "should be 0: a hit would flatter its TTFT.", "",
              "## Server overhead: the model step inside the server", "",
              "`beam_engine_step_seconds` (server/api/metrics.py): the engine thread's `ModelRunner.run`, from "
              "its start until the sampled tokens are on the host, per level (difference of /metrics before and "
              "after it). decode = every sequence feeds one token (a CUDA-graph replay where one is captured). "
              "'host prepare' (beam_engine_step_prepare_seconds): the part of the step before the forward is "
              "launched (inputs, page tables, attention plans), which the device never sees. 'device' "
              "(beam_engine_step_device_seconds, CUDA events): the GPU's time from the forward's launch until "
              "the tokens are drawn; the step's mean minus it is what the host adds.", "",
              "| users | kind | batch (rounded up) | steps | mean ms | p50 ms (bucket upper bound) "
              "| host prepare mean ms "
              "| device mean ms | grammar masks mean ms |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in levels:
        for s in (r.get("server") or {}).get("step_times", []):
            lines.append(f"| {r['concurrency']} | {s['kind']} | {s['batch']} | {s['steps']} | "
                         f"{f(s['mean_ms'], '.3f')} | "
                         f"{f(s['p50_ms_upper_bucket'], '.2f')} | {f(s.get('prepare_mean_ms'), '.3f')} | "
                         f"{f(s.get('device_mean_ms'), '.3f')} | {f(s.get('grammar_mean_ms'), '.3f')} |")
    lines += ["", "Client TPOT minus the server's decode step at the level's batch size is what the rest of the "
              "server (scheduler, detokenizer, asyncio, HTTP/SSE) and the prompts' prefill steps add per token:", "",
              "| users | client TPOT p50 ms | server decode step ms (batch) | difference ms | server ITL mean ms |",
              "|---:|---:|---:|---:|---:|"]
    for r in levels:
        dec = [s for s in (r.get("server") or {}).get("step_times", []) if s["kind"] == "decode"]
        if not dec or r.get("tpot_p50_ms") is None:
            continue
        top = max(dec, key=lambda s: s["steps"])
        lines.append(f"| {r['concurrency']} | {f(r['tpot_p50_ms'], '.2f')} | "
                     f"{f(top['mean_ms'], '.3f')} (b{top['batch']}) | "
                     f"{f(r['tpot_p50_ms'] - top['mean_ms'], '.2f')} | {f(r['server']['itl_mean_ms'], '.2f')} |")
    lines.append("")
    if opt:
        step = opt.get("step") or {}
        lines += [f"`workbench optimize` ({opt['file']}: {opt.get('target')} on {opt.get('preset')} "
                  f"{opt.get('dtype')}, batch {step.get('batch')}, context {step.get('context')}): "
                  f"locked step {f(opt.get('locked_ms'), '.3f')} ms, "
                  f"reference {f(opt.get('reference_ms'), '.3f')} ms. The server's batch-1 decode steps above ran at "
                  f"context {args.input_len}..{args.input_len + args.output_len}, so attention differs.", ""]
    else:
        lines += ["No `workbench optimize` report to compare with (pass --lock with a report.json beside it, or "
                  "--optimize-report FILE).", ""]
    lines += ["Files: sweep.json (every number above, each level's client command and the server's step-time "
              "breakdown), server.log, client.log (the client's own printed summaries), metrics-last.txt (the "
              "server's /metrics after the last level).", ""]
    (out / "report.md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
