"""Write a BF16 checkpoint in FP8 or NVFP4 (ModelOpt names and layouts, `quantization_config` in config.json)."""

from __future__ import annotations

import json
import os
import time


def add_arguments(p) -> None:
    p.add_argument("src", metavar="SRC", help="a BF16 checkpoint folder (config.json, safetensors)")
    p.add_argument("dst", metavar="DST", help="the folder to write")
    p.add_argument("--format", choices=("fp8", "nvfp4"), required=True,
                   help="fp8: attention, dense and expert projections, E4M3 per output channel; nvfp4: the "
                        "experts, E2M1 in blocks of 16 with E4M3 block scales and an FP32 global scale")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    from beam_model.quant.checkpoint import quantize_checkpoint

    started = time.perf_counter()
    scheme = quantize_checkpoint(args.src, args.dst, args.format)
    size = sum(os.path.getsize(os.path.join(args.dst, f)) for f in os.listdir(args.dst) if f.endswith(".safetensors"))
    src_size = sum(os.path.getsize(os.path.join(args.src, f)) for f in os.listdir(args.src)
                   if f.endswith(".safetensors"))
    out = {"src": args.src, "dst": args.dst, "quantization_config": scheme.to_config(), "bytes": size,
           "src_bytes": src_size, "seconds": round(time.perf_counter() - started, 2)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"wrote {args.dst}: {scheme.algo}, {size / 2**20:.1f} MiB of tensors ({src_size / 2**20:.1f} MiB in "
              f"{args.src}) in {out['seconds']} s")
    return 0
