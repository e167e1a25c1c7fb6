"""Train a DFlash drafter for a target checkpoint (beam-mini by default) by distillation; measure its acceptance."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import platform
import sys
import time

from workbench.commands.common import EMBEDDED_MODEL, given_command

STATE_FILE = "training-state.pt"  # an unfinished training's state (`--max-seconds`, `--resume`)
STOPPED_EARLY = 3  # the exit status of a training that `--max-seconds` stopped


def add_arguments(p) -> None:
    from workbench.training.drafter import DrafterOptions

    d = DrafterOptions()
    p.add_argument("out_dir", metavar="OUT_DIR", help="drafter folder to write (config.json, model.safetensors, "
                   "training.json, acceptance-<device>.json: cpu, or cuda- and the GPU's model)")
    p.add_argument("--target", default=EMBEDDED_MODEL, metavar="DIR",
                   help="the target checkpoint, whose training split it distils on (default: %(default)s)")
    p.add_argument("--layers", type=int, default=d.layers, help="draft layers (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help="the last accepted token and block-size - 1 drafts (default: %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch, help="windows per step (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per window (default: %(default)s)")
    p.add_argument("--anchors", type=int, default=d.anchors, help="blocks per window (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts the acceptance is measured on")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens generated per prompt when measuring")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="drafts a verify step when measuring (default: the block's, block size - 1; another K "
                        "writes acceptance-<device>[-locked]-k<K>.json)")
    p.add_argument("--lock", default=None, metavar="FILE",
                   help="measure with the variants a lock selects (verified first), in both models and every engine")
    p.add_argument("--plain-lock", default=None, metavar="FILE",
                   help="the engine without the drafter runs this lock's variants instead of --lock's (a decode lock "
                        "beside a verify lock: each build at the step it was searched for)")
    p.add_argument("--draft-lock", default=None, metavar="FILE",
                   help="the drafter's points run this lock's variants (one made at `--target draft-b1`)")
    p.add_argument("--force-lock", action="store_true",
                   help="use the locks even if they fail verification (acceptance-<device>.json and the card say why "
                        "each failed)")
    p.add_argument("--max-seconds", type=float, default=None, metavar="S",
                   help=f"stop training after S seconds, keeping where it stands in OUT_DIR/{STATE_FILE} (exit "
                        f"status {STOPPED_EARLY}); the same command with --resume goes on from there")
    p.add_argument("--resume", action="store_true",
                   help=f"go on from OUT_DIR/{STATE_FILE} (the same options; it is removed once training ends)")
    p.add_argument("--measure", action="store_true",
                   help="train nothing: measure OUT_DIR's drafter again (acceptance-<device>.json)")


def run(args) -> int:
    import torch

    from server.engine.acceptance import measure_acceptance
    from workbench.commands.common import resolve_device
    from workbench.lock import load_forced

    device = str(resolve_device(args.device))
    # the locks are verified before any training, so a lock that is refused costs no training time
    paths = {"lock": args.lock, "plain_lock": args.plain_lock, "draft_lock": args.draft_lock}
    loaded = {key: load_forced(path, force=args.force_lock, device=device) for key, path in paths.items() if path}
    if not args.measure and not _train(args, device):
        return STOPPED_EARLY
    figures = measure_acceptance(args.target, args.out_dir, prompts=args.prompts, max_tokens=args.max_tokens,
                                 device=device, num_speculative_tokens=args.num_speculative_tokens,
                                 **{key: lock for key, (lock, _) in loaded.items()})
    figures.update(paths)
    figures["forced_past"] = {paths[key]: problems for key, (_, problems) in loaded.items() if problems}
    figures["command"] = given_command(args)
    figures["torch"] = torch.__version__
    figures["python"] = platform.python_version()
    if device.startswith("cuda"):
        figures["device"] = f"{device} ({torch.cuda.get_device_name()})"
    # one file per kind of device (and with a lock's kernels or the references), side by side in the card
    drafts = figures["num_speculative_tokens"]
    k = f"-k{drafts}" if drafts != figures["block_size"] - 1 else ""
    name = f"acceptance-{device_kind(device)}{'-locked' if loaded else ''}{k}.json"
    with open(os.path.join(args.out_dir, name), "w") as f:
        json.dump(figures, f, indent=1)
        f.write("\n")
    with open(os.path.join(args.out_dir, "training.json")) as f:
        training = json.load(f)
    measured = []
    for name in sorted(glob.glob(os.path.join(args.out_dir, "acceptance-*.json"))):
        with open(name) as f:
            measured.append(json.load(f))
    with open(os.path.join(args.out_dir, "README.md"), "w") as f:
        f.write(card(training, measured))
    for mode, m in figures["modes"].items():
        for name in ("fixed", "adaptive"):
            v = m[name]
            print(f"{mode}, {name} verification: {v['mean_acceptance_length']:.2f} tokens per verify step, "
                  f"{v['speedup']:.2f}x the tokens per second without the drafter")
    return 0


def device_kind(device: str) -> str:
    """`cpu`, or `cuda-` and the GPU's model (`cuda-h200`): figures from two kinds of GPU stand side by side."""
    import re

    import torch

    kind = torch.device(device).type
    if kind != "cuda":
        return kind
    words = torch.cuda.get_device_name(torch.device(device)).split()
    model = words[1] if len(words) > 1 and words[0] == "NVIDIA" else "-".join(words)
    return f"cuda-{re.sub(r'[^a-z0-9.-]+', '-', model.lower())}"


def card(training: dict, measured: list[dict]) -> str:
    """The drafter folder's README.md, from its training.json and its acceptance-<device>.json files."""
    o, last = training["options"], training["history"][-1]
    lines = [
        f"# {os.path.basename(os.path.normpath(measured[0]['drafter']))}", "",
        f"A DFlash drafter for `{os.path.basename(os.path.normpath(training['target']))}`: {o['layers']} draft "
        f"layers, blocks of {o['block_size']} ({training['parameters']} parameters of its own; the target's "
        "embedding and LM head are shared), distilled on the target's training split. Made with:", "",
        f"    {training['command']}", "",
        f"on {training['device']} in {training['train_seconds']} s (torch {training['torch']}, the standard library "
        f"of Python {training.get('python', '?')}); at the last step the drafter's most likely token was the "
        f"target's for {last[2][0]:.1%} of first drafts ({sum(last[2]) / len(last[2]):.1%} over the block).", "",
        "## Acceptance on held-out text", "",
    ]
    for acceptance in measured:
        lines += acceptance_table(acceptance)
    return "\n".join(lines)


def acceptance_table(acceptance: dict) -> list[str]:
    """One measurement's section of the card: what was run, tokens per verify step and speed."""
    graphs = (f" (CUDA graphs: {acceptance['cuda_graphs']})" if isinstance(acceptance.get("cuda_graphs"), str)
              else " (CUDA graphs for the steps without the drafter and for the fixed verify + draft steps of "
              "greedy and unseeded requests; adaptive steps eager)" if acceptance.get("cuda_graphs") else "")
    kernels = _kernels(acceptance)
    locked = any(acceptance.get(k) for k in ("lock", "plain_lock", "draft_lock"))
    lines = [
        f"### {acceptance['device']}{', locked kernels' if locked else ''}", "",
        f"{acceptance['prompts']} prompts of {acceptance['prompt_tokens']} tokens from the held-out files, each "
        f"served alone for {acceptance['max_tokens']} tokens through the engine, "
        f"{acceptance['num_speculative_tokens']} drafts a verify step, {acceptance['dtype']}{graphs}, "
        f"{kernels}, without the drafter, with it verifying every draft (fixed) and as many as pay (adaptive), "
        "in the same process:",
        "", "| sampling | verification | tokens per verify step | verify steps | tokens/s | speed-up "
        "| decode tokens/s | decode speed-up | ms a step: wall, before launch, device |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, m in acceptance["modes"].items():
        lines.append(f"| {mode} | none | | | {m['tokens_per_second_plain']:.1f} | 1.00x | "
                     f"{_decode(m.get('decode_tokens_per_second_plain'), 1.0)} | "
                     f"{_step_ms(m.get('step_ms_plain'))} |")
        for name in ("fixed", "adaptive"):
            v = m[name]
            length = f"{v['mean_acceptance_length']:.2f}" if v["verify_steps"] else "-"
            lines.append(f"| {mode} | {name} | {length} | {v['verify_steps']} | "
                         f"{v['tokens_per_second']:.1f} | {v['speedup']:.2f}x | "
                         f"{_decode(v.get('decode_tokens_per_second'), v.get('decode_speedup'))} | "
                         f"{_step_ms(v.get('step_ms'))} |")
    equal = [f"{name} {m[name]['equal_to_plain']}" for m in acceptance["modes"].values()
             for name in ("fixed", "adaptive") if "equal_to_plain" in m[name]]
    if equal:
        lines += ["", "Greedy outputs equal to those without the drafter: " + ", ".join(equal) + "."]
        if any(not e.endswith(f" {acceptance['prompts']}/{acceptance['prompts']}") for e in equal):
            lines[-1] += (f" In {acceptance['dtype']} a verify step's projections multiply several rows at once and "
                          "round differently from a one-row step's, so a near-tie between two tokens can go the "
                          "other way (the engine's equality is tested in float32).")
    for path, problems in (acceptance.get("forced_past") or {}).items():
        lines += ["", f"`{path}` was used past failed verification (--force-lock): " + "; ".join(problems) + "."]
    lines += ["", "Measured with:", "", f"    {acceptance['command']}", ""]
    return lines


def _decode(tokens_per_second: float | None, speedup: float | None) -> str:
    """The decode-only cells (tokens/s | speed-up), blank in files measured before they were kept."""
    if tokens_per_second is None:
        return " | "
    return f"{tokens_per_second:.1f} | {speedup:.2f}x"


def _step_ms(ms: dict | None) -> str:
    """A step's median milliseconds (`acceptance.StepTimes`), blank in files measured before they were kept."""
    if not ms:
        return ""
    device = "-" if ms["device"] is None else f"{ms['device']:.3f}"
    return f"{ms['wall']:.3f}, {ms['before_launch']:.3f}, {device}"


def _kernels(acceptance: dict) -> str:
    """Which variants each engine and model ran, in words."""
    def of(path):
        return f"the variants of `{path}`" if path else "the reference variants"

    lock, plain, draft = (acceptance.get(k) for k in ("lock", "plain_lock", "draft_lock"))
    if not (plain or draft):
        return f"both models on {of(lock)}"
    return (f"the target on {of(lock)} with the drafter, on {of(plain or lock)} without it, the drafter on "
            f"{of(draft or lock)}")


def _train(args, device: str) -> bool:
    """Train OUT_DIR's drafter; False where `--max-seconds` stopped it first (its state kept to resume)."""
    import torch

    from beam_model.tokenizer import load_tokenizer
    from workbench.training.corpus import corpus_files, split
    from workbench.training.data import encode_files
    from workbench.training.drafter import DrafterOptions, DrafterTrainer, converted, frozen_target

    started = time.perf_counter()
    tokenizer = load_tokenizer(args.target)
    train_files, _ = split(corpus_files())
    stream = encode_files(tokenizer, [f.read() for f in train_files])
    target = frozen_target(args.target, device)
    opts = DrafterOptions(layers=args.layers, block_size=args.block_size, steps=args.steps, batch=args.batch,
                          seq_len=args.seq_len, anchors=args.anchors, lr=args.lr,
                          warmup=min(args.warmup, max(args.steps - 1, 0)), seed=args.seed, device=device)
    trainer = DrafterTrainer(opts, target, stream)
    state_path, seconds_before = os.path.join(args.out_dir, STATE_FILE), 0.0
    if args.resume:
        if not os.path.exists(state_path):
            raise ValueError(f"--resume: no unfinished training to go on from ({state_path} does not exist)")
        try:
            state = torch.load(state_path, map_location="cpu", weights_only=True)
            trainer_state, seconds_before = state["trainer"], state["seconds"]
        except Exception as e:  # noqa: BLE001 - whatever is wrong with the file, say which file
            raise ValueError(f"--resume: {state_path} is not a training state this command wrote "
                             f"({type(e).__name__}: {e})") from e
        trainer.load_state_dict(trainer_state)
        print(f"resuming at step {len(trainer.history)} of {opts.steps}", file=sys.stderr)
    every = max(1, opts.steps // 50)
    print(f"training a {opts.layers}-layer drafter reading layers {trainer.drafter.config.target_layer_ids} of "
          f"{args.target} on {len(stream)} tokens; {device}", file=sys.stderr)

    def line(step, loss, agree, seconds):
        if step % every == 0 or step == opts.steps:
            print(f"step {step}/{opts.steps} loss {loss:.4f} top-1 agreement: first draft {agree[0]:.3f}, "
                  f"mean {sum(agree) / len(agree):.3f} {seconds:.0f} s", file=sys.stderr, flush=True)

    drafter = trainer.run(line, max_seconds=args.max_seconds)
    seconds = seconds_before + time.perf_counter() - started
    if drafter is None:
        os.makedirs(args.out_dir, exist_ok=True)
        torch.save({"trainer": trainer.state_dict(), "seconds": seconds}, state_path + ".tmp")
        os.replace(state_path + ".tmp", state_path)
        print(f"stopped at step {len(trainer.history)} of {opts.steps} after --max-seconds {args.max_seconds:g}; "
              f"the same command with --resume goes on from {state_path}", file=sys.stderr)
        return False
    converted(drafter, torch.bfloat16).save_pretrained(args.out_dir)
    for stale in glob.glob(os.path.join(args.out_dir, "acceptance-*.json")):  # the replaced weights' figures
        os.remove(stale)
    with open(os.path.join(args.out_dir, "training.json"), "w") as f:
        json.dump({"command": given_command(args), "target": args.target,
                   "options": dataclasses.asdict(opts), "train_seconds": round(seconds, 1),
                   "device": f"{platform.machine()} ({os.cpu_count()} cores)" if device == "cpu"
                   else torch.cuda.get_device_name(), "torch": torch.__version__,
                   "python": platform.python_version(),  # whose standard library the corpus is
                   "parameters": sum(p.numel() for p in drafter.parameters()),
                   "history": trainer.history}, f, indent=1)
        f.write("\n")
    if os.path.exists(state_path):
        os.remove(state_path)
    return True
