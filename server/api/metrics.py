"""Prometheus metrics: request counters and latency histograms observed by the handlers, the model
step time observed by the engine thread (beam_engine_step_seconds), engine gauges (running/waiting,
KV pages per group, prefix-cache hits) read from the engine's latest snapshot at scrape time. A
registry per app, so tests can build several apps in one process. Must never block on or call into
the engine thread."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

disable_created_metrics()  # the *_created series only add noise to every scrape

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.02, 0.025,
                0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
PREPARE_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01,
                   0.025, 0.1)
# The `batch` label of beam_engine_step_seconds: sequences in the step, rounded up to one of these
# (the CUDA-graph batch sizes), so the label has few values.
STEP_BATCH_LABELS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)


def batch_label(n: int) -> str:
    return str(next((b for b in STEP_BATCH_LABELS if b >= n), STEP_BATCH_LABELS[-1]))


class _EngineCollector:
    def __init__(self, async_engine):
        self.engine = async_engine

    def collect(self):
        s = self.engine.stats()
        yield GaugeMetricFamily("beam_requests_running", "Requests being computed", value=s["running"])
        yield GaugeMetricFamily("beam_requests_waiting", "Requests waiting for admission", value=s["waiting"])
        for name, key, doc in (("beam_kv_pages_used", "pages_used", "KV pages referenced by requests"),
                               ("beam_kv_pages_cached", "pages_cached", "Unreferenced KV pages kept for prefix reuse"),
                               ("beam_kv_pages_total", "pages_total", "KV pages in the pool (page 0 excluded)")):
            g = GaugeMetricFamily(name, doc, labels=["group"])
            for group, v in s[key].items():
                g.add_metric([group], v)
            yield g
        yield CounterMetricFamily("beam_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=s["prefix_queried_tokens"])
        yield CounterMetricFamily("beam_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                  value=s["prefix_hit_tokens"])
        q = s["prefix_queried_tokens"]
        yield GaugeMetricFamily("beam_prefix_cache_hit_rate", "Hit tokens / queried tokens since start",
                                value=s["prefix_hit_tokens"] / q if q else 0.0)
        yield CounterMetricFamily("beam_preemptions", "Sequences preempted for lack of KV pages",
                                  value=s["preemptions"])
        spec = s.get("speculative")
        if spec is not None:
            yield from _speculative(spec)


def _speculative(spec: dict):
    """The drafter's counters: verify steps, drafted and kept tokens, tokens per verify step, and the
    histogram of drafts kept per verify step (acceptance length - 1)."""
    yield CounterMetricFamily("beam_spec_decode_verify_steps", "Decode steps that verified drafts",
                              value=spec["verify_steps"])
    yield CounterMetricFamily("beam_spec_decode_draft_tokens", "Draft tokens verified", value=spec["drafted"])
    yield CounterMetricFamily("beam_spec_decode_accepted_tokens", "Draft tokens kept", value=spec["accepted"])
    steps = spec["verify_steps"]
    yield GaugeMetricFamily("beam_spec_decode_mean_acceptance_length",
                            "Tokens per verify step (kept drafts + the target's own token) since start",
                            value=1.0 + spec["accepted"] / steps if steps else 0.0)
    counts, buckets, total = spec["histogram"], [], 0
    for kept, n in enumerate(counts):
        total += n
        buckets.append((str(kept), total))
    buckets.append(("+Inf", total))
    yield HistogramMetricFamily("beam_spec_decode_kept_drafts", "Drafts kept per verify step", buckets=buckets,
                                sum_value=spec["accepted"])


class Metrics:
    def __init__(self, async_engine):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("beam_requests", "Finished requests", ["endpoint", "finish_reason"], registry=r)
        self.rejected = Counter("beam_requests_rejected", "Requests answered with an HTTP error", ["status"],
                                registry=r)
        self.prompt_tokens = Counter("beam_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("beam_generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.ttft = Histogram("beam_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("beam_inter_token_latency_seconds", "Time between generated tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("beam_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.step = Histogram(
            "beam_engine_step_seconds",
            "Wall time of one model step on the engine thread (ModelRunner.run: inputs, forward or graph "
            "replay, sampling), from its start until its sampled tokens are on the host; no extra device "
            "synchronization is added, so a step that samples nothing (a prompt chunk mid-prompt) shows "
            "launch time only and its device time lands in the next step. kind: decode (every sequence "
            "feeds one token), prefill (prompt tokens only) or mixed; batch: sequences in the step, rounded "
            "up to 1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256",
            ["kind", "batch"], buckets=STEP_BUCKETS, registry=r)
        self.step_prepare = Histogram(
            "beam_engine_step_prepare_seconds",
            "Host time of one model step before its forward is launched (inputs, page tables, attention "
            "plans): the part of beam_engine_step_seconds the device never sees; same labels",
            ["kind", "batch"], buckets=PREPARE_BUCKETS, registry=r)
        self.step_device = Histogram(
            "beam_engine_step_device_seconds",
            "GPU time of one model step from its forward's launch until its tokens are drawn (CUDA events): "
            "beam_engine_step_seconds minus this is the host's share of the step; CUDA only; same labels",
            ["kind", "batch"], buckets=STEP_BUCKETS, registry=r)
        self.step_grammar = Histogram(
            "beam_engine_step_grammar_seconds",
            "Host time of one model step spent on grammar masks (structured outputs: filling each "
            "constrained row's mask while the forward runs, and starting its copy); steps with a "
            "constrained row only; same labels",
            ["kind", "batch"], buckets=PREPARE_BUCKETS, registry=r)
        async_engine.engine.step_observer = self.observe_step  # called on the engine thread (thread-safe)
        r.register(_EngineCollector(async_engine))

    def observe_step(self, kind: str, num_seqs: int, seconds: float, prepare: float,
                     device: float | None = None, grammar: float | None = None) -> None:
        self.step.labels(kind, batch_label(num_seqs)).observe(seconds)
        self.step_prepare.labels(kind, batch_label(num_seqs)).observe(prepare)
        if device is not None:
            self.step_device.labels(kind, batch_label(num_seqs)).observe(device)
        if grammar is not None:
            self.step_grammar.labels(kind, batch_label(num_seqs)).observe(grammar)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, endpoint: str) -> "RequestTimer":
        return RequestTimer(self, endpoint)


class RequestTimer:
    """One request's latencies and, once, its totals."""

    def __init__(self, metrics: Metrics, endpoint: str):
        self.m, self.endpoint = metrics, endpoint
        self.start = self.last = time.perf_counter()
        self.first = True
        self.done = False

    def tokens(self, n: int) -> None:
        if not n:
            return
        now = time.perf_counter()
        if self.first:
            self.m.ttft.observe(now - self.start)
            self.first = False
        else:
            self.m.itl.observe(now - self.last)
        self.last = now

    def finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        if self.done:
            return
        self.done = True
        self.m.requests.labels(self.endpoint, reason).inc()
        self.m.prompt_tokens.inc(prompt_tokens)
        self.m.generation_tokens.inc(completion_tokens)
        self.m.e2e.observe(time.perf_counter() - self.start)
