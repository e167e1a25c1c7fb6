"""The server with a DFlash drafter (`workbench serve --draft-model`), end to end with the official
`openai` client: the trained beam-mini and its committed drafter on the CPU, beside the same model
served without it. Greedy completions are equal token for token, concurrent and streamed, and with a
JSON schema and logprobs; /metrics counts verify steps, drafted and kept tokens."""

import asyncio
import os
import signal

import pytest

from tests.server_harness import ROOT, ServerProcess

MINI = os.path.join(ROOT, "models", "beam-mini")
DRAFTER = os.path.join(ROOT, "models", "beam-mini-drafter")
PROMPTS = ["def parse_args(argv):\n    ", "class Queue:\n    def __init__(self", "import os\nimport sys\n\n",
           "    for i in range(len(items)):\n"]

pytestmark = pytest.mark.skipif(not os.path.isdir(DRAFTER), reason="no committed beam-mini drafter")


@pytest.fixture(scope="module")
def servers():
    plain = ServerProcess(model=("--model", MINI), scripted=False, num_pages=64)
    try:
        drafted = ServerProcess("--draft-model", DRAFTER, "--num-speculative-tokens", "7", model=("--model", MINI),
                                scripted=False, num_pages=64)
    except Exception:
        plain.stop()
        raise
    yield plain, drafted
    for srv in (plain, drafted):
        assert srv.stop() in (0, -signal.SIGTERM), srv.log()


async def _complete_all(server, **kw):
    client = server.async_client()
    outs = await asyncio.gather(*(client.completions.create(model="beam-mini", prompt=p, max_tokens=40,
                                                            temperature=0.0, **kw) for p in PROMPTS))
    return [o.choices[0].text for o in outs]


def test_greedy_completions_are_the_targets_under_concurrency(servers):
    plain, drafted = servers
    assert asyncio.run(_complete_all(drafted)) == asyncio.run(_complete_all(plain))
    m = drafted.metrics()
    assert m["beam_spec_decode_verify_steps_total"] > 0 and m["beam_spec_decode_accepted_tokens_total"] > 0, m
    assert m["beam_spec_decode_mean_acceptance_length"] > 1.0
    assert m['beam_spec_decode_kept_drafts_bucket{le=+Inf}'] == m["beam_spec_decode_verify_steps_total"]


def test_a_streamed_completion_is_the_same_text(servers):
    plain, drafted = servers
    want = plain.client().completions.create(model="beam-mini", prompt=PROMPTS[0], max_tokens=40, temperature=0.0)
    chunks = drafted.client().completions.create(model="beam-mini", prompt=PROMPTS[0], max_tokens=40,
                                                 temperature=0.0, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == want.choices[0].text


def test_structured_and_logprobs_requests_are_the_targets(servers):
    """A JSON-schema chat turn with logprobs and a reasoning budget: drafted under its grammar, the same
    message and the same logprobs as without the drafter."""
    import json

    plain, drafted = servers
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "size"],
              "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer"}}}
    kw = dict(model="beam-mini", messages=[{"role": "user", "content": "Name a file and its size."}],
              max_tokens=120, temperature=0.0, logprobs=True, top_logprobs=2, extra_body={"thinking_token_budget": 8},
              response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": schema, "strict": True}})
    kept = drafted.metrics()["beam_spec_decode_accepted_tokens_total"]
    want, got = plain.client().chat.completions.create(**kw), drafted.client().chat.completions.create(**kw)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert set(json.loads(got.choices[0].message.content)) == {"name", "size"}
    a, b = want.choices[0].logprobs.content, got.choices[0].logprobs.content
    assert [t.token for t in a] == [t.token for t in b]
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b)) < 1e-3
    assert drafted.metrics()["beam_spec_decode_accepted_tokens_total"] > kept  # its drafts were kept


def test_sampled_requests_are_served(servers):
    _, drafted = servers
    out = drafted.client().completions.create(model="beam-mini", prompt=PROMPTS[1], max_tokens=24, temperature=1.0,
                                              top_p=0.95, seed=3)
    assert out.usage.completion_tokens == 24 and out.choices[0].finish_reason == "length"


def test_speculative_flags_without_a_drafter_are_refused():
    import subprocess
    import sys

    serve = [sys.executable, "-m", "workbench.cli", "serve", "--preset", "beam-tiny", "--device", "cpu"]
    for flags, why in ((["--num-speculative-tokens", "4"], "need --draft-model"),
                       (["--draft-lock", "lock.yaml"], "--draft-lock binds the drafter's points: it needs")):
        run = subprocess.run(serve + flags, capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert run.returncode != 0 and why in run.stderr, run.stderr
