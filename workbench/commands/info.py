"""Show a preset's layer map, parameter counts, KV bytes per token and the backends available here."""

from __future__ import annotations

import importlib.util

from workbench.commands.common import print_json

LIBRARIES = ("torch", "triton", "flashinfer", "cutlass", "quack", "nvtx")


def add_arguments(p) -> None:
    p.add_argument("--preset", default="beam-501b", help="preset to describe (default: %(default)s)")
    p.add_argument("--model", metavar="DIR", help="describe a checkpoint folder's config.json instead")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _library_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    dists = {"flashinfer": "flashinfer-python", "cutlass": "nvidia-cutlass-dsl", "quack": "quack-kernels"}
    out = {}
    for lib in LIBRARIES:
        if importlib.util.find_spec(lib) is None:
            out[lib] = None
            continue
        try:
            out[lib] = version(dists.get(lib, lib))
        except PackageNotFoundError:
            out[lib] = "present"
    return out


def describe(config) -> dict:
    import torch

    return {
        "preset": config.preset,
        "config_hash": config.config_hash(),
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "layer_map": [
            {"layer": i, "attention": "full" if t == "full_attention" else "sliding",
             "mlp": "moe" if config.is_moe_layer(i) else "dense"}
            for i, t in enumerate(config.layer_types)
        ],
        "full_attention_layers": config.full_attention_layers,
        "num_parameters": config.num_parameters,
        "num_active_parameters": config.num_active_parameters,
        "kv_bytes_per_token_bf16": config.kv_bytes_per_token(2),
        "sliding_kv_bytes_per_sequence_bf16": config.swa_kv_bytes(2),
        "libraries": _library_versions(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


def run(args) -> int:
    from beam_model.config import BeamConfig

    config = BeamConfig.from_pretrained(args.model) if args.model else BeamConfig.from_preset(args.preset)
    info = describe(config)
    if args.json:
        print_json(info)
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    kinds = "".join("F" if r["attention"] == "full" else "s" for r in info["layer_map"])
    mlps = "".join("M" if r["mlp"] == "moe" else "D" for r in info["layer_map"])
    table = Table(title=f"Beam {info['preset'] or args.model} (config {info['config_hash']})", show_header=False)
    table.add_row("layers", f"{info['layers']} (hidden {info['hidden_size']})")
    table.add_row("attention", f"{kinds}  (s sliding, F full: {info['full_attention_layers']})")
    table.add_row("mlp", f"{mlps}  (D dense, M MoE)")
    table.add_row("parameters", f"{info['num_parameters'] / 1e9:,.3f} B total, "
                                f"{info['num_active_parameters'] / 1e9:,.3f} B active per token")
    table.add_row("KV cache", f"{info['kv_bytes_per_token_bf16'] / 1024:g} KiB per token (BF16, full layers) + "
                              f"{info['sliding_kv_bytes_per_sequence_bf16'] / 2**20:g} MiB per sequence (sliding)")
    libs = ", ".join(f"{k} {v}" if v else f"{k} [dim](missing)[/]" for k, v in info["libraries"].items())
    table.add_row("libraries", libs)
    table.add_row("CUDA devices", ", ".join(info["cuda_devices"]) or "none")
    console.print(table)
    return 0
