"""Load: 64 concurrent streaming clients for a bounded time against a real server. No errors, every
response complete, all KV pages back in the pool afterwards, and the metrics agree with what the
clients saw. Half the clients share a long system prompt, so prefix-cache pages are shared under
concurrency too.
"""

import asyncio
import random
import signal
import time

import pytest

from tests.server_harness import MODEL, ServerProcess, metric_sum

CLIENTS = 64
DURATION_S = 6.0
SHARED_SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 3  # > 2 full pages


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess()
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM), srv.log()


async def _client(i: int, client, deadline: float, done: list):
    rng = random.Random(i)
    while time.monotonic() < deadline:
        max_tokens = rng.randint(2, 24)
        if rng.random() < 0.5:
            messages = [{"role": "user", "content": f"client {i} asks question {rng.random():.6f}"}]
            if i % 2:
                messages.insert(0, {"role": "system", "content": SHARED_SYSTEM})
            stream = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True}, temperature=rng.choice([0.0, 0.8]))
            kind = "chat"
        else:
            stream = await client.completions.create(
                model=MODEL, prompt=f"{SHARED_SYSTEM if i % 2 else ''}story {i} {rng.random():.6f}",
                max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
            kind = "completions"
        reasons, usage, text = [], None, []
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                if c.finish_reason:
                    reasons.append(c.finish_reason)
                text.append((c.delta.content or "") if kind == "chat" else c.text)
        done.append((kind, max_tokens, reasons, usage))


async def _run_load(server):
    client = server.async_client(timeout=60)
    done: list = []
    deadline = time.monotonic() + DURATION_S
    await asyncio.gather(*(_client(i, client, deadline, done) for i in range(CLIENTS)))
    await client.close()
    return done


def test_64_concurrent_streaming_clients(server):
    before = server.metrics()
    done = asyncio.run(_run_load(server))
    assert len(done) >= CLIENTS
    for kind, max_tokens, reasons, usage in done:
        assert len(reasons) == 1 and reasons[0] in ("stop", "length"), (kind, reasons)
        assert usage is not None and 1 <= usage.completion_tokens <= max_tokens
        # "length" exactly at the cap; "stop" anywhere up to it (a stop token may be the last allowed one)
        if reasons[0] == "length":
            assert usage.completion_tokens == max_tokens, (kind, usage)
    stats = server.wait_idle(timeout=10)
    assert stats["running"] == stats["waiting"] == stats["in_flight"] == 0
    assert stats["pages_used"] == {"full_attention": 0, "sliding_attention": 0}
    after = server.metrics()

    def delta(name):
        return metric_sum(after, name) - metric_sum(before, name)

    assert delta("beam_requests_total") == len(done)
    assert delta("beam_prompt_tokens_total") == sum(u.prompt_tokens for *_, u in done)
    assert delta("beam_generation_tokens_total") == sum(u.completion_tokens for *_, u in done)
    assert delta("beam_time_to_first_token_seconds_count") == len(done)
    assert delta("beam_inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for *_, u in done)
    assert after["beam_requests_running"] == after["beam_requests_waiting"] == 0
    assert after["beam_kv_pages_used{group=full_attention}"] == 0
    assert after["beam_kv_pages_used{group=sliding_attention}"] == 0
    assert delta("beam_prefix_cache_hit_tokens_total") > 0  # the shared system prompt was reused
    assert 0 < after["beam_prefix_cache_hit_rate"] < 1
    assert sum(u.prompt_tokens_details.cached_tokens for *_, u in done) == delta("beam_prefix_cache_hit_tokens_total")
    assert delta("beam_requests_rejected_total") == 0
