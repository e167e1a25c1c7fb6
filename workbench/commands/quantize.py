"""Write a BF16 checkpoint in FP8 or NVFP4 (ModelOpt names and layouts, `quantization_config` in config.json)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time


def add_arguments(p) -> None:
    p.add_argument("src", metavar="SRC", help="a BF16 checkpoint folder (config.json, safetensors), or a preset "
                                             "name: its random weights (--seed)")
    p.add_argument("dst", metavar="DST", help="the folder to write")
    p.add_argument("--format", choices=("fp8", "nvfp4"), required=True,
                   help="fp8: attention, dense and expert projections, E4M3 per output channel; nvfp4: the "
                        "experts, E2M1 in blocks of 16 with E4M3 block scales and an FP32 global scale")
    p.add_argument("--accuracy", type=int, nargs="?", const=4096, default=None, metavar="TOKENS",
                   help="then compare the quantized model with its source on TOKENS positions (default 4096): top-1 "
                        "agreement and KL divergence of the next-token distributions, into DST/accuracy.json")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per compared window (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed when SRC is a preset")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    with contextlib.ExitStack() as cleanup:
        return _run(args, _source_folder(args, cleanup))


def _source_folder(args, cleanup: contextlib.ExitStack) -> str:
    """SRC as a checkpoint folder: a preset's random weights are written to a temporary one first."""
    from beam_model.config import PRESETS

    if os.path.isdir(args.src):
        return args.src
    if args.src not in PRESETS:
        raise FileNotFoundError(f"{args.src} is neither a checkpoint folder nor a preset ({', '.join(PRESETS)})")
    import torch

    from beam_model.model import BeamForCausalLM

    folder = cleanup.enter_context(tempfile.TemporaryDirectory(prefix=f"{args.src}-"))
    BeamForCausalLM.from_preset(args.src, seed=args.seed, dtype=torch.bfloat16).save_pretrained(folder)
    return folder


def _run(args, src: str) -> int:
    from beam_model.quantized_checkpoint import quantize_checkpoint

    started = time.perf_counter()
    scheme = quantize_checkpoint(src, args.dst, args.format)
    size = sum(os.path.getsize(os.path.join(args.dst, f)) for f in os.listdir(args.dst) if f.endswith(".safetensors"))
    src_size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src) if f.endswith(".safetensors"))
    out = {"src": args.src, "dst": args.dst, "quantization_config": scheme.to_config(), "bytes": size,
           "src_bytes": src_size, "seconds": round(time.perf_counter() - started, 2)}
    if args.accuracy:
        out["accuracy"] = _accuracy(args, src)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"wrote {args.dst}: {scheme.algo}, {size / 2**20:.1f} MiB of tensors ({src_size / 2**20:.1f} MiB in "
              f"{args.src}) in {out['seconds']} s")
        if args.accuracy:
            a = out["accuracy"]
            print(f"against {args.src} on {a['positions']} positions of {a['tokens']}: top-1 agreement "
                  f"{a['top1_agreement']:.4f}, KL mean {a['kl_mean']:.3g} (p99 {a['kl_p99']:.3g}) nats")
    return 0


def _accuracy(args, src: str) -> dict:
    import torch

    from beam_model.model import BeamForCausalLM
    from workbench.commands.common import given_command
    from workbench.quant_accuracy import compare, tokens_for

    windows, where = tokens_for(src, args.accuracy, args.seq_len)
    source = BeamForCausalLM.from_pretrained(src, dtype=torch.float32, device=args.device)
    quantized = BeamForCausalLM.from_pretrained(args.dst, dtype=torch.float32, device=args.device)
    result = {"command": given_command(args), "tokens": where, "device": args.device,
              **compare(source, quantized, windows.to(args.device))}
    with open(os.path.join(args.dst, "accuracy.json"), "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    return result
