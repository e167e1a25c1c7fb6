"""AGENTS.md's walk-through, run as written: its `workbench` commands (as separate processes, in a
scratch folder) and its file contents, in document order, with the Triton interpreter on the CPU."""

import json
import os
import re
import shlex
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^```(\w+)[ \t]*(\S*)\n(.*?)^```", re.M | re.S)


def walkthrough() -> list[tuple[str, str, str]]:
    """(language, file path or "", body) of each code block of the walk-through section."""
    with open(os.path.join(ROOT, "AGENTS.md")) as f:
        text = f.read()
    section = text.split("## Walk-through", 1)[1].split("\n## ", 1)[0]
    return FENCE.findall(section)


def test_walkthrough_has_the_steps():
    blocks = walkthrough()
    assert [lang for lang, _, _ in blocks] == ["bash", "python", "bash"]
    assert blocks[1][1] == "my_variants/head__my_softcap.py"
    assert "@triton.jit" in blocks[1][2]


def test_walkthrough_runs(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    outputs = []
    for lang, path, body in walkthrough():
        if lang == "python":
            target = tmp_path / path
            assert target.is_file(), f"the walk-through writes {path} over the scaffold"
            assert '@register("head", "my_softcap", "triton")' in target.read_text()
            target.write_text(body)
            continue
        for line in body.strip().splitlines():
            argv = shlex.split(line)
            assert argv[0] == "workbench"
            done = subprocess.run([sys.executable, "-m", "workbench.cli", *argv[1:], "--json"], cwd=tmp_path,
                                  env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, (line, done.stdout[-2000:], done.stderr[-2000:])
            outputs.append(json.loads(done.stdout))
    made, checked, timed = outputs
    assert made["path"] == str(tmp_path / "my_variants" / "head__my_softcap.py")
    (row,) = checked["results"]
    assert (row["variant"], row["backend"], row["status"]) == ("my_softcap", "triton", "pass"), row
    rows = {r["variant"]: r for r in timed["rows"]}
    assert rows["my_softcap"]["error"] is None and rows["my_softcap"]["speedup_vs_reference"] > 0
