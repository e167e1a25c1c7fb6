"""Train Beam's byte-level BPE tokenizer on the Python standard library (`tokenizer train OUT_DIR`)."""

from __future__ import annotations

import json
import platform
import time


def add_arguments(p) -> None:
    from workbench.training.bpe import DEFAULT_VOCAB_SIZE

    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    train = sub.add_parser(
        "train", help="train on the stdlib's training split; write tokenizer.json + tokenizer_config.json",
        description="Train a byte-level BPE on the training split of the running interpreter's standard "
                    "library (workbench/training/corpus.py says which files and which are held out), write "
                    "tokenizer.json, tokenizer_config.json (with the Jinja chat template) and "
                    "tokenizer_training.json (the figures below) into OUT_DIR, and print the held-out "
                    "compression in bytes per token.")
    train.add_argument("out_dir", metavar="OUT_DIR", help="folder to write the tokenizer files into")
    train.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                       help="ids in all, the 9 special tokens included (default: %(default)s)")
    train.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    from beam_model.tokenizer import save_tokenizer_folder
    from workbench.training import bpe
    from workbench.training.corpus import HELD_OUT_PERCENT, corpus_files, split, stdlib_root

    t0 = time.perf_counter()
    root = stdlib_root()
    train_files, held_files = split(corpus_files(root))
    tok = bpe.train_bpe((f.read() for f in train_files), args.vocab_size)
    t1 = time.perf_counter()
    out = save_tokenizer_folder(tok, args.out_dir)
    held = bpe.compression(tok, [f.read() for f in held_files])
    t2 = time.perf_counter()
    figures = {
        "corpus": str(root), "python": platform.python_version(), "held_out_percent": HELD_OUT_PERCENT,
        "train_files": len(train_files), "held_out_files": len(held_files),
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "held_out_bytes": held["bytes"], "held_out_tokens": held["tokens"],
        "held_out_bytes_per_token": round(held["bytes_per_token"], 4),
        "train_s": round(t1 - t0, 2), "total_s": round(t2 - t0, 2),
    }
    (out / "tokenizer_training.json").write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print(f"trained a {figures['vocab_size']}-id byte-level BPE on {len(train_files)} files of {root} "
              f"(Python {figures['python']}) in {figures['train_s']} s; wrote {out}/tokenizer.json, "
              "tokenizer_config.json, tokenizer_training.json")
        print(f"held out: {len(held_files)} files, {held['bytes']} bytes -> {held['tokens']} tokens: "
              f"{figures['held_out_bytes_per_token']} bytes per token")
    return 0
