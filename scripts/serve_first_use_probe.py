"""Which serving steps still compile after the engine's start-up warm-up, and what they compile.

An Engine (no HTTP) on a lock's variants, warmed up as `workbench serve` does, then requests that
arrive while others decode, as at the 8-user level of `scripts/serve_sweep.py`: prompts of
--prompt-tokens (cycled when several), --max-tokens each, a new request every --arrive-every steps.
Every step's kind, sequences, tokens fed, seconds and the Triton kernels it specialised first
(`server/engine/first_use.py`) go to --out as JSON; steps over --slow seconds are printed.

Give it a fresh TRITON_CACHE_DIR to see a new host's first requests: Triton's disk cache hides the
compile times (not which kernels specialised).

    TRITON_CACHE_DIR=$(mktemp -d) python3 scripts/serve_first_use_probe.py \
        --lock runs/optimize-decode-b1-beam-501b-tp8/lock.yaml --out probe.json
"""

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from beam_model import BeamForCausalLM  # noqa: E402
from beam_model.tokenizer import ByteTokenizer  # noqa: E402
from server.engine import Engine, SamplingParams  # noqa: E402
from workbench.lock import Lock  # noqa: E402
from workbench.variants.inputs import DTYPES  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lock", help="lock file whose variants to serve (default: the reference)")
    ap.add_argument("--preset", help="model preset (default: the lock's, else beam-tiny)")
    ap.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: the lock's, else bf16)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--arrive-every", type=int, default=5, help="steps between arrivals")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--slow", type=float, default=0.2, help="print steps slower than this (s)")
    ap.add_argument("--no-warm-up", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()

    lock = None
    if args.lock:
        lock, problems = Lock.load(args.lock)
        if problems:
            print("lock problems (served as written):", problems)
    preset = args.preset or (lock.model["preset"] if lock else "beam-tiny")
    dtype = args.dtype or (lock.model["dtype"] if lock else "bf16")
    device = torch.device(args.device)
    started = time.perf_counter()
    model = BeamForCausalLM.from_preset(preset, dtype=DTYPES[dtype], device=device)
    engine = Engine(model, ByteTokenizer(), variants=lock.selection if lock else None,
                    variant_configs=lock.configs if lock else None, max_num_seqs=args.max_num_seqs)
    print(f"engine on {preset} ({dtype}, {device}) in {time.perf_counter() - started:.1f} s", flush=True)
    warm = None
    if not args.no_warm_up:
        started = time.perf_counter()
        warm = {"steps": engine.warm_up(), "seconds": time.perf_counter() - started}
        print(f"warm-up: {warm['steps']} steps in {warm['seconds']:.1f} s", flush=True)

    rng = random.Random(0)
    vocab = min(engine.config.vocab_size, engine.tokenizer.vocab_size)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    steps, added = [], 0
    while added < args.users or engine.has_unfinished():
        if added < args.users and len(steps) >= added * args.arrive_every:
            n = args.prompt_tokens[added % len(args.prompt_tokens)]
            engine.add_request(f"probe-{added}", [rng.randrange(vocab) for _ in range(n)], params)
            added += 1
        started = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - started
        if engine.last_step is None:  # nothing ran (requests only finished)
            continue
        kind, n_seqs, fed = engine.last_step
        step = {"step": len(steps), "seconds": seconds, "kind": kind, "sequences": n_seqs, "tokens_fed": fed,
                "first_uses": engine.last_first_uses}
        steps.append(step)
        if seconds > args.slow:
            print(f"step {step['step']}: {seconds:.3f} s, {step['kind']}, {step['sequences']} sequences, tokens fed "
                  f"{step['tokens_fed']}, first specialised: {len(step['first_uses'])} "
                  f"{sorted(set(s.split('[', 1)[0] for s in step['first_uses']))}", flush=True)
    slow = [s for s in steps if s["seconds"] > args.slow]
    print(f"{len(steps)} steps, {len(slow)} over {args.slow} s, "
          f"{sum(bool(s['first_uses']) for s in steps)} with first specialisations", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "preset": preset, "dtype": dtype, "device": str(device),
                       "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                       "torch": torch.__version__, "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
                       "warm_up": warm, "steps": steps}, f, indent=1)


if __name__ == "__main__":
    main()
