"""Held-out figures of a model under training or trained: cross-entropy per token and bits per UTF-8
byte (`Evaluation`), the router's behaviour on the same text (`routing_statistics`), and what `xz -9`
achieves on the same files (`xz_bits_per_byte`), the bar a language model of code must clear.
"""

from __future__ import annotations

import lzma
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from workbench.training.data import TokenStream, eval_windows
from workbench.training.lm import RouteRecorder, window_logits


@dataclass
class Evaluation:
    tokens: int                # predicted tokens
    bytes: int                 # their UTF-8 bytes
    loss: float                # nats per token
    bits_per_byte: float
    routing: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def evaluate(model, stream: TokenStream, *, seq_len: int, batch: int, max_tokens: int | None = None,
             routing: bool = False, autocast: torch.dtype | None = None) -> Evaluation:
    """The model's cross-entropy on `stream`'s consecutive windows (at most `max_tokens` predicted)."""
    windows = eval_windows(stream, seq_len, max_tokens)
    model.set_variants()  # the weights as they are now, bound once: nothing here is differentiated
    recorder = RouteRecorder(model)
    recorder.attach()
    nats, n_bytes, n_tokens, per_layer = 0.0, 0, 0, {}
    device = model.device
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch].to(device)
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            logits = window_logits(model, w[:, :-1], cache_dtype=autocast)
        targets = w[:, 1:].flatten()
        nats += F.cross_entropy(logits, targets, reduction="sum").item()
        n_bytes += int(stream.token_bytes[targets.cpu()].sum())
        n_tokens += targets.numel()
        if routing:
            for layer, ids in recorder.ids.items():
                per_layer.setdefault(layer, []).append(ids.view(len(w), -1, ids.shape[-1]).cpu())
    stats = routing_statistics({k: torch.cat(v) for k, v in per_layer.items()},
                               model.config.n_routed_experts) if routing else None
    return Evaluation(n_tokens, n_bytes, nats / n_tokens, nats / math.log(2) / max(n_bytes, 1), stats)


def routing_statistics(ids: dict[int, torch.Tensor], experts: int) -> dict:
    """Per MoE layer and averaged, from expert ids [windows, T, k]: how unevenly experts are loaded (max
    over mean load, coefficient of variation) and how often consecutive tokens share experts (the mean
    fraction of a token's k experts that the next token also uses; `uniform_share` is k / experts, what
    independent uniform choices would give)."""
    layers = {}
    for layer, x in sorted(ids.items()):
        k = x.shape[-1]
        load = torch.bincount(x.flatten(), minlength=experts).double()
        onehot = torch.zeros(*x.shape[:2], experts, dtype=torch.bool)
        onehot.scatter_(2, x, True)
        shared = (onehot[:, 1:] & onehot[:, :-1]).sum(-1).double() / k
        layers[str(layer)] = {"max_over_mean_load": round((load.max() / load.mean()).item(), 4),
                              "load_cv": round((load.std() / load.mean()).item(), 4),
                              "next_token_share": round(shared.mean().item(), 4)}
    k = next(iter(ids.values())).shape[-1] if ids else 0
    mean = {key: round(sum(v[key] for v in layers.values()) / len(layers), 4)
            for key in ("max_over_mean_load", "load_cv", "next_token_share")} if layers else {}
    return {"layers": layers, "mean": mean, "uniform_share": round(k / experts, 4) if experts else None}


def xz_bits_per_byte(texts: list[str]) -> dict:
    """`xz -9` (LZMA2, preset 9) on the files concatenated, and on each file alone: bits per byte."""
    data = [t.encode("utf-8") for t in texts]
    raw = sum(len(d) for d in data)
    whole = len(lzma.compress(b"".join(data), preset=9))
    each = sum(len(lzma.compress(d, preset=9)) for d in data)
    return {"bytes": raw, "concatenated_bits_per_byte": 8 * whole / raw, "per_file_bits_per_byte": 8 * each / raw}
