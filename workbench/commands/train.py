"""Train a Beam model (beam-mini by default) on the standard library's Python source; write a checkpoint."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time


def add_arguments(p) -> None:
    from workbench.training.bpe import DEFAULT_VOCAB_SIZE
    from workbench.training.models import CONFIGS
    from workbench.training.train import TrainOptions

    d = TrainOptions()
    p.add_argument("out_dir", metavar="OUT_DIR", help="checkpoint folder to write (config.json, model.safetensors, "
                   "tokenizer files, training.json, loss_curve.svg and .png where matplotlib is installed, "
                   "README.md rendered from training.json)")
    p.add_argument("--config", choices=list(CONFIGS), default=d.config, help="what to train (default: %(default)s)")
    p.add_argument("--tokenizer", metavar="DIR", help="a folder with tokenizer.json (and tokenizer_config.json) "
                   "to use; default: train one on the training split")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                   help="vocabulary of the tokenizer trained here (default: %(default)s)")
    p.add_argument("--corpus", metavar="DIR", help="a folder of .py files instead of the standard library")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch, help="windows per step (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per window (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--bias-rate", type=float, default=d.bias_rate,
                   help="the router balancing step per update (default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-tokens", type=int, default=d.eval_tokens,
                   help="held-out tokens per evaluation during training (default: %(default)s)")
    p.add_argument("--final-eval-tokens", type=int, default=None,
                   help="held-out tokens the saved checkpoint is evaluated on (default: all of them)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--render", action="store_true",
                   help="train nothing: render OUT_DIR's README.md and loss curve again from its training.json")
    p.add_argument("--json", action="store_true", help="print the final figures as JSON")


def render(out_dir: str, figures: dict) -> None:
    """loss_curve.svg, loss_curve.png (where matplotlib is installed) and README.md from the figures."""
    from workbench.training.card import model_card
    from workbench.training.plot import loss_curve_png, loss_curve_svg

    train, evals = figures["history"]["train"], figures["history"]["evals"]
    title = f"{figures['config']}: {figures['options']['steps']} steps"
    with open(os.path.join(out_dir, "loss_curve.svg"), "w") as f:
        f.write(loss_curve_svg(train, evals, title))
    png = loss_curve_png(train, evals, title, os.path.join(out_dir, "loss_curve.png"))
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(model_card(figures, curve="loss_curve.png" if png else "loss_curve.svg"))


def run(args) -> int:
    import torch

    if args.render:
        with open(os.path.join(args.out_dir, "training.json")) as f:
            render(args.out_dir, json.load(f))
        print(f"rendered {args.out_dir}/README.md and its loss curve from training.json")
        return 0

    from beam_model.model import BeamForCausalLM
    from beam_model.tokenizer import HFTokenizer, copy_tokenizer_files, save_tokenizer_folder
    from workbench.commands.common import resolve_device
    from workbench.training import bpe
    from workbench.training.corpus import HELD_OUT_PERCENT, corpus_files, split, stdlib_root
    from workbench.training.data import encode_files
    from workbench.training.evaluate import evaluate, xz_bits_per_byte
    from workbench.training.models import to_bf16, training_config
    from workbench.training.train import Trainer, TrainOptions

    started = time.perf_counter()
    device = str(resolve_device(args.device))
    root = args.corpus or stdlib_root()
    train_files, held_files = split(corpus_files(root))
    if not train_files or not held_files:
        raise ValueError(f"{root}: the corpus needs files on both sides of the split "
                         f"({len(train_files)} training, {len(held_files)} held out)")
    train_texts, held_texts = [f.read() for f in train_files], [f.read() for f in held_files]
    os.makedirs(args.out_dir, exist_ok=True)
    if args.tokenizer:
        if "tokenizer.json" not in copy_tokenizer_files(args.tokenizer, args.out_dir):
            raise FileNotFoundError(f"no tokenizer.json in {args.tokenizer}")
    else:
        save_tokenizer_folder(bpe.train_bpe(train_texts, args.vocab_size), args.out_dir)
    tokenizer = HFTokenizer(os.path.join(args.out_dir, "tokenizer.json"))
    train_stream, held_stream = encode_files(tokenizer, train_texts), encode_files(tokenizer, held_texts)
    config = training_config(args.config, tokenizer.vocab_size)
    opts = TrainOptions(config=args.config, steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
                        warmup=min(args.warmup, max(args.steps - 1, 0)), bias_rate=args.bias_rate,
                        eval_every=args.eval_every, eval_tokens=args.eval_tokens, seed=args.seed, device=device)
    trainer = Trainer(opts, config, train_stream, held_stream)
    print(f"training {args.config} ({config.num_parameters / 1e6:.1f}M parameters, "
          f"{config.num_active_parameters / 1e6:.1f}M active) on {len(train_files)} files, "
          f"{len(train_stream)} tokens; {len(held_files)} files, {len(held_stream)} tokens held out; {opts.device}",
          file=sys.stderr)
    history = _run_with_progress(trainer)
    trained_s = time.perf_counter() - started

    to_bf16(trainer.model).save_pretrained(args.out_dir)
    del trainer
    model = BeamForCausalLM.from_pretrained(args.out_dir, device=device)
    final = evaluate(model, held_stream, seq_len=opts.seq_len, batch=opts.batch, max_tokens=args.final_eval_tokens,
                     routing=True)
    xz = xz_bits_per_byte(held_texts)
    sample = _sample(model, tokenizer)
    figures = {
        "command": "workbench train " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["train"] else None,
        "config": args.config, "parameters": config.num_parameters, "active_parameters": config.num_active_parameters,
        "options": dataclasses.asdict(opts), "device": _device_name(device),
        "python": platform.python_version(), "torch": torch.__version__,
        "corpus": {"root": str(root), "stdlib": not args.corpus, "held_out_percent": HELD_OUT_PERCENT,
                   "train_files": len(train_files),
                   "train_tokens": len(train_stream), "held_out_files": len(held_files),
                   "held_out_tokens": len(held_stream), "held_out_bytes": held_stream.text_bytes},
        "train_seconds": round(trained_s, 1), "tokens_seen": opts.steps * opts.batch * opts.seq_len,
        "checkpoint": {"dtype": "bf16", **final.to_dict()}, "xz_9": xz, "sample": sample,
        "history": {"train": history.train, "evals": history.evals},
    }
    with open(os.path.join(args.out_dir, "training.json"), "w") as f:
        json.dump(figures, f, indent=1)
        f.write("\n")
    render(args.out_dir, figures)
    summary = {"held_out_bits_per_byte": final.bits_per_byte, "xz_9_bits_per_byte": xz["concatenated_bits_per_byte"],
               "held_out_loss": final.loss, "routing": final.routing["mean"], "out_dir": args.out_dir}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"wrote {args.out_dir}: held out {final.bits_per_byte:.3f} bits per byte "
              f"(xz -9: {xz['concatenated_bits_per_byte']:.3f}), {final.loss:.3f} nats per token; "
              f"routing {final.routing['mean']}")
    return 0


SAMPLE_PROMPT = "def fibonacci(n):"


def _sample(model, tokenizer, max_new_tokens: int = 64) -> dict:
    """The checkpoint's greedy continuation of SAMPLE_PROMPT in its BF16 weights."""
    from beam_model.generate import generate

    out = generate(model, [tokenizer.encode(SAMPLE_PROMPT)], max_new_tokens, stop_ids=(tokenizer.eos_token_id,),
                   vocab_limit=tokenizer.vocab_size)[0]
    return {"prompt": SAMPLE_PROMPT, "greedy_tokens": max_new_tokens, "text": tokenizer.decode(out)}


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _run_with_progress(trainer):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    if not console.is_terminal:  # a log file: a line every 1% of the steps and at each evaluation
        every = max(1, trainer.opts.steps // 100)

        def line(step, loss, lr, seconds):
            if step % every == 0 or step == trainer.opts.steps:
                print(f"step {step}/{trainer.opts.steps} loss {loss:.4f} lr {lr:.2e} {seconds:.0f} s",
                      file=sys.stderr, flush=True)

        def held(e):
            print(f"held out at step {e['step']}: {e['loss']:.4f} nats per token, {e['bits_per_byte']:.4f} bits "
                  "per byte", file=sys.stderr, flush=True)

        return trainer.run(line, held)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
               TextColumn("{task.fields[status]}"))
    with Progress(*columns, console=console) as progress:  # stdout: the figures
        task = progress.add_task("train", total=trainer.opts.steps, status="")
        held = {"text": ""}

        def on_step(step, loss, lr, seconds):
            progress.update(task, completed=step, status=f"loss {loss:.3f} lr {lr:.2e}{held['text']}")

        def on_eval(e):
            held["text"] = f" | held out {e['bits_per_byte']:.3f} bits/byte @ {e['step']}"

        return trainer.run(on_step, on_eval)
