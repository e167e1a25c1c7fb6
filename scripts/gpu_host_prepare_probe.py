"""Where a batch-1 serving decode step's time goes outside the model's CUDA graph.

An Engine on a lock's variants (no HTTP), one request decoding --steps tokens after a --prompt-tokens
prompt. Each decode step's `ModelRunner.run` is split, by timers around its parts:
- host, before the graph's launch: `_sampling_params` (the sampled rows' settings to the device; since
  the graphs draw, only eager steps call it), `GraphInputs.fill` (tokens, positions, page tables,
  settings), `model.replan` (host plans), the rest;
- the device's time from the launch to the drawn tokens (CUDA events, `last_device_seconds`), and
  of it the graph alone (an event after its replay);
- after the launch on the host: `_sample` (its launches and the wait for the tokens).
The engine's whole step (scheduler, detokenizer) is timed around `Engine.step`. --out for a file.
With --compare, the steps alternate in blocks of --block between the graphs as captured and the same
graphs with their draw ignored (each step's tokens drawn after the replay, eagerly, as before the
graphs drew them), in one process: each mode's medians apart. A lock variant whose backend this host
lacks is replaced by the point's Triton variant (recorded in the file).

    PYTHONPATH=. python3 scripts/gpu_host_prepare_probe.py --lock runs/optimize-decode-b1-beam-501b-tp8/lock.yaml \
        [--compare] --out probe.json
"""

import argparse
import json
import statistics
import sys
import time

import torch

from beam_model import BeamForCausalLM
from beam_model.tokenizer import ByteTokenizer
from server.engine import Engine, SamplingParams
from workbench import registry
from workbench.lock import Lock
from workbench.variants._inputs import DTYPES


class Timers:
    """Host seconds of wrapped methods, per step."""

    def __init__(self):
        self.now: dict[str, float] = {}

    def wrap(self, owner, name: str, label: str):
        inner = getattr(owner, name)

        def timed(*a, **k):
            started = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.now[label] = self.now.get(label, 0.0) + time.perf_counter() - started

        setattr(owner, name, timed)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lock", help="lock whose variants to serve (default: the reference)")
    ap.add_argument("--preset", default="beam-tiny", help="without --lock")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script, no device times")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--compare", action="store_true", help="alternate draws in the graph with eager draws")
    ap.add_argument("--block", type=int, default=20, help="steps a block with --compare")
    ap.add_argument("--out")
    args = ap.parse_args()
    lock, problems = Lock.load(args.lock) if args.lock else (None, [])
    selection, configs, stand_ins = (dict(lock.selection), dict(lock.configs), {}) if lock else (None, None, {})
    for point, name in (selection or {}).items():
        why = registry.get(point, name).unsupported(device=torch.device(args.device))
        if why:
            selection[point], stand_ins[point] = "triton", f"{name}: {why}"
            configs.pop(point, None)
    model = BeamForCausalLM.from_preset(lock.model["preset"] if lock else args.preset,
                                        dtype=DTYPES[lock.model["dtype"] if lock else "bf16"],
                                        device=torch.device(args.device))
    engine = Engine(model, ByteTokenizer(), variants=selection, variant_configs=configs)
    engine.warm_up()
    runner = engine.runner
    timers = Timers()
    timers.wrap(runner, "_sampling_params", "sampling_params")
    if hasattr(runner, "_inputs"):  # captured graphs (CUDA) only
        timers.wrap(runner._inputs, "fill", "fill")
    timers.wrap(runner.model, "replan", "replan")
    timers.wrap(runner, "_sample", "sample_host")
    timers.wrap(runner, "run", "run")
    cuda = args.device == "cuda"
    graph_done = torch.cuda.Event(enable_timing=True) if cuda else None
    replay = runner._replay

    def replay_marked(*a, **k):
        out = replay(*a, **k)
        if cuda:
            graph_done.record()
        return out

    runner._replay = replay_marked
    drawing = dict(runner.graphs)
    eager = {size: c._replace(ids=None) for size, c in drawing.items()} if args.compare else drawing
    params = SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
    engine.add_request("probe", [i % 200 + 32 for i in range(args.prompt_tokens)], params)
    rows = []
    while engine.has_unfinished():
        mode = "eager draw" if args.compare and (engine.num_steps // args.block) % 2 else "graph draw"
        runner.graphs = eager if mode == "eager draw" else drawing
        timers.now = {}
        started = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - started
        if engine.last_step is None or engine.last_step[0] != "decode":
            continue
        device = runner.last_device_seconds
        graph = runner._events[0].elapsed_time(graph_done) / 1e3 if cuda else None
        rows.append({"mode": mode, "engine_step": seconds, "prepare": runner.last_prepare_seconds, "device": device,
                     "graph": graph, **timers.now})
    rows = rows[len(rows) // 10:]  # the first steps settle allocators and caches
    keys = ["engine_step", "run", "prepare", "sampling_params", "fill", "replan", "device", "graph", "sample_host"]
    summary = {}
    for mode in sorted({r["mode"] for r in rows}):
        of = [r for r in rows if r["mode"] == mode]
        summary[mode] = {k: 1e3 * statistics.median(v) if (v := [r[k] for r in of if r.get(k) is not None]) else None
                         for k in keys}
        print(f"{mode}, median of {len(of)} decode steps: " + ", ".join(
            f"{k} {v:.3f} ms" for k, v in summary[mode].items() if v is not None), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "lock_problems": problems, "stand_ins": stand_ins,
                       "gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
                       "median_ms": summary, "steps": rows}, f, indent=1)


if __name__ == "__main__":
    main()
