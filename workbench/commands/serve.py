"""Serve the model over an OpenAI-compatible HTTP API (chat, completions, metrics).

Loads a checkpoint (--model), a preset with random weights (--preset), or else the preset a lock was made
on, else the embedded trained model (models/beam-mini) where present, else beam-tiny; optionally the
variant selection of a lock file (--lock), and runs the continuous-batching engine behind FastAPI/uvicorn.
Hidden test flag: --fake-model-script FILE forces scripted replies (server/engine/testing.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from server.api.structures import CONSTRAIN
from workbench.commands.common import add_model_arguments, choose_model, load_model, resolve_device


def add_arguments(p) -> None:
    add_model_arguments(p, embedded_default=True)
    p.add_argument("--lock", metavar="FILE", help="serve the variant selection of a lock file (verified first)")
    p.add_argument("--force-lock", action="store_true", help="serve a lock even if it fails verification")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("BEAM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $BEAM_API_KEY, else none)")
    p.add_argument("--served-model-name", help="model id clients send (default: the preset or folder name)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU the server may use, KV pages included (default: %(default)s)")
    p.add_argument("--num-pages", type=int, help="full-attention KV pages (overrides the memory-based size)")
    p.add_argument("--max-num-seqs", type=int, help="most requests computed at once (default: 256 CUDA, 128 CPU)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="token budget of one step, decode + prompt chunks (default: 2048 CUDA, 1024 CPU)")
    p.add_argument("--max-queue-len", type=int, default=1024,
                   help="requests that may wait beyond --max-num-seqs before new ones get 503 (default: %(default)s)")
    p.add_argument("--no-prefix-caching", action="store_true", help="never reuse KV pages across requests")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    p.add_argument("--no-warm-up", action="store_true",
                   help="skip the start-up steps that compile prompt and mixed-step kernels before the first "
                        "request (run on CUDA only: nothing compiles on the CPU)")
    p.add_argument("--constrained-decoding", default="tools", choices=CONSTRAIN,
                   help="what is decoded under the chat template's grammar without the request asking: 'tools' "
                        "(requests that offer tools: every call parses and matches its tool's schema), 'all' "
                        "(every chat turn), 'off' (only response_format and thinking_token_budget; tool_choice "
                        "required/named only prefills the call's start) (default: %(default)s)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism: N processes, each with its slice of every layer (one GPU each on "
                        "CUDA; gloo on the CPU); rank 0 serves (default: %(default)s)")
    p.add_argument("--ep", "--enable-expert-parallel", dest="ep", action="store_true",
                   help="with --tp N: the MoE layers split by whole experts over the N ranks (E/N each) instead of "
                        "each expert's slice; attention, dense layers, embedding and head stay tensor-parallel")
    p.add_argument("--draft-lock", metavar="FILE",
                   help="bind the drafter's points to this lock's variants (one made by `workbench optimize --target "
                        "draft-b1` on the model) instead of --lock's")
    p.add_argument("--draft-model", metavar="DIR", help="a DFlash drafter folder for the model (`workbench "
                   "train-drafter`): decode steps verify its drafts (speculative decoding)")
    p.add_argument("--num-speculative-tokens", type=int, metavar="K",
                   help="drafts verified per decode step (default: the drafter's block size - 1)")
    p.add_argument("--adaptive-verification", action="store_true",
                   help="verify only as many drafts as the drafter's confidence and the measured step cost say "
                   "are worth it")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--fake-model-script", help=argparse.SUPPRESS)  # test-only, see server/engine/testing.py


def load_lock(path: str, *, force: bool, device):
    """The verified lock (refused with the reason if it does not verify, unless forced)."""
    from workbench.lock import load_for_serving

    return load_for_serving(path, force=force, device=device)


def check_lock_matches(lock, model, force: bool) -> None:
    """A lock was measured on one model config; serving its variants on another is refused."""
    locked = (lock.model or {}).get("config_hash")
    if locked and locked != model.config.config_hash() and not force:
        raise ValueError(f"the lock was made for model config {locked} ({lock.model.get('preset')}), "
                         f"but this model has config {model.config.config_hash()}; use --force-lock to serve anyway")
    weights = (lock.model or {}).get("weights", "bf16")
    if weights != model.weights:  # its choices were gated and timed on weights stored otherwise
        raise ValueError(f"the lock was made for {weights} weights, but this model's are {model.weights}: "
                         f"lock a build on {model.weights} weights (optimize --weights {model.weights})")


def lock_warnings(lock, max_num_seqs: int) -> list[str]:
    """What a lock cannot promise for this server: shapes it was not searched at."""
    out = []
    compiled = sorted(p for p, v in lock.selection.items() if v == "torch_compile")
    if compiled:  # compiled with static shapes: each new prompt layout compiles again (seconds each)
        out.append(f"the lock selects torch_compile for {', '.join(compiled)}: prompt steps of new shapes "
                   "recompile (decode steps replay CUDA graphs captured at start-up)")
    from workbench.targets import get_target

    try:
        target = get_target(lock.target)
    except KeyError:
        return out + [f"the lock names an unknown target {lock.target!r}: its choices were timed at other shapes"]
    if not target.decode:
        out.append(f"the lock was searched at {target.name}: decode steps run its choices untimed")
    elif max_num_seqs > target.batch:
        out.append(f"the lock was searched at {target.name} (batch {target.batch}); decode batches up to "
                   f"{max_num_seqs} run its choices untimed (a lock searched at a larger decode target fits them)")
    return out


def run(args) -> int:
    from beam_model.tokenizer import load_tokenizer
    from server.api.server import serve
    from server.engine import Engine

    device = resolve_device(args.device)
    lock = load_lock(args.lock, force=args.force_lock, device=device) if args.lock else None  # before the model
    choose_model(args, lock)
    if args.tp < 1:
        raise ValueError(f"--tp must be at least 1, got {args.tp}")
    if args.ep and args.tp < 2:
        raise ValueError("--ep splits the experts over the --tp ranks: give --tp 2 or more")
    ranks = _Ranks(args, device) if args.tp > 1 else None
    model = ranks.model if ranks else load_model(args)
    if lock is not None:
        check_lock_matches(lock, model, args.force_lock)
    tokenizer = load_tokenizer(args.model)
    hook = None
    if args.fake_model_script:
        from server.engine.testing import ScriptedLogits

        hook = ScriptedLogits.from_file(tokenizer, args.fake_model_script)
    draft_lock = _draft_lock(args, model, device)
    engine = Engine(model, tokenizer, variants=lock.selection if lock else None,
                    variant_configs=lock.configs if lock else None, num_pages=args.num_pages,
                    gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens, prefix_caching=not args.no_prefix_caching,
                    cuda_graphs=device.type == "cuda" and not args.enforce_eager, logits_hook=hook,
                    on_runner_plan=ranks.send_plan if ranks else None, drafter=_drafter(args, model),
                    num_speculative_tokens=args.num_speculative_tokens,
                    adaptive_verification=args.adaptive_verification,
                    drafter_variants=draft_lock.selection if draft_lock else None,
                    drafter_variant_configs=draft_lock.configs if draft_lock else None)
    if ranks:
        ranks.leader.attach(engine.runner)
    if device.type == "cuda" and not args.no_warm_up:
        started = time.perf_counter()
        steps = engine.warm_up()
        print(f"warm-up: {steps} steps in {time.perf_counter() - started:.1f} s", flush=True)
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if args.model else args.preset)
    if lock is not None:
        for line in lock_warnings(lock, engine.max_num_seqs):
            print(f"warning: {line}", file=sys.stderr, flush=True)
    parallel = f", TP{args.tp}{' EP' if args.ep else ''}" if ranks else ""
    print(f"serving {name} on http://{args.host}:{args.port} ({device}{parallel}, "
          f"{engine.num_pages} KV pages, context {engine.max_model_len}, "
          f"variants {model.ops.selection if lock else 'reference'})", flush=True)
    try:
        code = serve(engine, tokenizer, host=args.host, port=args.port, served_model_name=name, api_key=args.api_key,
                     max_queue_len=args.max_queue_len, log_level=args.log_level, constrain=args.constrained_decoding,
                     stop=ranks.stop if ranks else None)
    finally:
        if ranks:
            ranks.close()
    return 1 if ranks and ranks.watch.died else code


def _draft_lock(args, model, device):
    """The --draft-lock lock, verified and checked against the served model, or None."""
    if not args.draft_lock:
        return None
    if not args.draft_model:
        raise ValueError("--draft-lock binds the drafter's points: it needs --draft-model")
    lock = load_lock(args.draft_lock, force=args.force_lock, device=device)
    check_lock_matches(lock, model, args.force_lock)
    if lock.target != "draft-b1":
        print(f"warning: the --draft-lock was searched at {lock.target}, not at the drafter's step (draft-b1)",
              file=sys.stderr, flush=True)
    return lock


def _drafter(args, model):
    """The --draft-model drafter attached to `model`, or None."""
    if (args.num_speculative_tokens is not None or args.adaptive_verification) and not args.draft_model:
        raise ValueError("--num-speculative-tokens and --adaptive-verification need --draft-model")
    if not args.draft_model:
        return None
    if args.tp > 1:
        raise ValueError("--draft-model runs on one GPU today; it cannot be combined with --tp")
    from beam_model.drafter import BeamDrafter

    return BeamDrafter.from_pretrained(args.draft_model, model)


class _Ranks:
    """Rank 0 of `--tp N`: the other ranks started and watched, this rank's shard, the leader's channel."""

    def __init__(self, args, device):
        from server.engine.ranks import Leader, RankWatch
        from workbench.commands import serve_ranks

        dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
        spec, self.procs, control = serve_ranks.start(args, args.tp, device, dtype)
        self.stop = threading.Event()  # set when a rank dies: the server's graceful stop
        self.watch = RankWatch(self.procs, on_death=self.stop.set)
        self.model = serve_ranks.load_rank_model(spec, 0)
        self.leader = Leader(control)

    def send_plan(self, plan: dict) -> None:
        self.leader.send_plan(plan, self.model.ops.selection, self.model.ops.configs)

    def close(self) -> None:
        import torch.distributed as dist

        self.watch.stopping()
        if not self.watch.died:
            self.leader.stop()
            for p in self.procs.values():
                p.join(timeout=30)
        dist.destroy_process_group()
