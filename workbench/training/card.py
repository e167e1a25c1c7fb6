"""The README a trained checkpoint folder carries, rendered from its `training.json` (no figure in it is
typed by hand): what the model is, the command that made it, held-out bits per byte beside `xz -9`, the
router's statistics, and the loss curve."""

from __future__ import annotations


def model_card(f: dict, *, curve: str) -> str:
    ck, xz, corpus, opts = f["checkpoint"], f["xz_9"], f["corpus"], f["options"]
    r = ck.get("routing") or {}
    mean = r.get("mean", {})
    source = "the Python standard library's training split" if corpus.get("stdlib", True) else \
        f"the .py files under {corpus['root']}"
    lines = [
        f"# {f['config']}",
        "",
        f"A Beam model with every structural feature of the architecture, trained from scratch by "
        f"`workbench train` on {source} ({corpus['train_files']} files, "
        f"{corpus['train_tokens']} tokens; Python {f['python']}). {f['parameters'] / 1e6:.1f}M parameters, "
        f"{f['active_parameters'] / 1e6:.1f}M active per token; BF16 safetensors (router FP32).",
        "",
        "Made with:",
        "",
        f"    {f['command'] or 'workbench train'}",
        "",
        f"on {f['device']} in {f['train_seconds']:.0f} s (torch {f['torch']}): {opts['steps']} steps of "
        f"{opts['batch']} x {opts['seq_len']} tokens, {f['tokens_seen']} tokens seen.",
        "",
        "## Held out",
        "",
        f"The {corpus['held_out_files']} held-out files ({corpus['held_out_bytes']} bytes, "
        f"{ck['tokens']} predicted tokens), never trained on, through this checkpoint as it is saved:",
        "",
        "| | bits per byte |",
        "| --- | --- |",
        f"| {f['config']} | {ck['bits_per_byte']:.4f} |",
        f"| `xz -9`, the files concatenated | {xz['concatenated_bits_per_byte']:.4f} |",
        f"| `xz -9`, each file alone | {xz['per_file_bits_per_byte']:.4f} |",
        "",
        f"Cross-entropy {ck['loss']:.4f} nats per token.",
        "",
        "## Routing on held-out text",
        "",
        f"Over the MoE layers (each layer in `training.json`): the most loaded expert carries "
        f"{mean.get('max_over_mean_load', float('nan')):.2f} x the mean load (coefficient of variation "
        f"{mean.get('load_cv', float('nan')):.2f}); consecutive tokens share "
        f"{mean.get('next_token_share', float('nan')):.1%} of their experts (independent uniform choices: "
        f"{r.get('uniform_share') or float('nan'):.1%}).",
        "",
        *_sample_lines(f["sample"]),
        "## Loss",
        "",
        f"![loss curve]({curve})",
        "",
    ]
    return "\n".join(lines)


def _sample_lines(sample: dict) -> list[str]:
    return ["## A greedy continuation", "",
            f"`workbench generate --prompt {sample['prompt']!r} --max-tokens {sample['greedy_tokens']} --dtype bf16` "
            "(greedy, the checkpoint's BF16 weights):", "",
            "```python", sample["prompt"] + sample["text"], "```", ""]
