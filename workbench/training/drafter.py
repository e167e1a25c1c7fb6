"""`workbench train-drafter`: a DFlash drafter distilled from its target on the target's training split.

Each step runs the frozen target over random windows (its reference points, no gradients) for its
tapped layers' hidden states and its logits, picks `anchors` block starts p per window, and trains the
drafter to predict, at each mask position p + i of the block [x_p, mask, ...], the target's own
distribution for that position (soft cross-entropy against the target's softmax at p + i - 1), with
the context features of the positions before p (at most the drafter's window). Position i's loss is
weighted exp(-(i - 1) / (B / 2)): an early draft's miss ends the accepted prefix, a late one's rarely
matters. AdamW (decay on matrices), linear warm-up and a cosine schedule (`train.learning_rate`).

The target is distilled from in the dtype the engine serves it in on the device (`frozen_target`): BF16
on a GPU, whose outputs are the ones the drafter must match there, and FP32 on the CPU. With a BF16
target the drafter trains under BF16 autocast (FP32 master weights), as `workbench train` does.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from beam_model.drafter import ContextKV
from workbench.training.data import TokenStream, random_windows


@dataclasses.dataclass
class DrafterOptions:
    layers: int = 5             # the architecture's drafter
    block_size: int = 16
    steps: int = 400
    batch: int = 8             # windows per step
    seq_len: int = 256
    anchors: int = 16          # blocks per window
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    autocast: bool | None = None  # BF16 autocast for the drafter; None: when the target is BF16


def position_weights(block_size: int, device=None) -> torch.Tensor:
    """The loss weight of each mask position 1 .. B - 1."""
    i = torch.arange(block_size - 1, dtype=torch.float32, device=device)
    return torch.exp(-i / (block_size / 2))


def initial_drafter(config, target, *, seed: int, device):
    """An FP32 drafter for `target` by the target's own initial rules (`models.initial_value`): projections
    N(0, 1/fan_in), the mask vector N(0, 1), norms 1, gate biases 0."""
    from beam_model.drafter import BeamDrafter
    from beam_model.weights import _set_param
    from workbench.training.models import initial_value

    drafter = BeamDrafter(config, dtype=torch.float32)
    drafter.attach(target)
    gen = torch.Generator().manual_seed(seed)
    for name, p in list(drafter.named_parameters()):
        _set_param(drafter, name, initial_value(name, tuple(p.shape), gen).to(device))
        drafter.get_parameter(name).requires_grad_(True)
    drafter.set_variants()
    return drafter


@torch.no_grad()
def target_outputs(target, windows: torch.Tensor, taps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's tapped streams [b, T, features] and FP32 logits [b, T, vocab] over `windows` [b, T]."""
    from beam_model.kv_cache import PagedKVCache

    b, t = windows.shape
    cache = PagedKVCache.for_sequences(target.config, [t] * b, dtype=target.dtype, device=target.device)
    for s in range(b):
        cache.add(s)
    step = cache.prepare_step(list(range(b)), [t] * b)
    logits, tapped = target.step(windows.flatten(), cache, step, all_logits=True, taps=tuple(taps))
    return tapped.view(b, t, -1), logits.float().view(b, t, -1)


def anchor_blocks(windows: torch.Tensor, n: int, block_size: int, generator: torch.Generator) -> torch.Tensor:
    """[b, n] block starts p per window, each with a full block of targets inside it (p <= T - B + 1)."""
    b, t = windows.shape
    if t < block_size + 1:
        raise ValueError(f"windows of {t} tokens hold no block of {block_size}")
    return torch.randint(1, t - block_size + 2, (b, n), generator=generator)


def block_loss(drafter, windows, tapped, logits, starts) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted soft cross-entropy of the drafter's blocks at `starts` [b, n], and per mask position
    [B - 1] the fraction whose most likely draft is the target's most likely token."""
    cfg = drafter.config
    bsz, t = windows.shape
    blk, c_len = cfg.block_size, cfg.sliding_window
    # every window's context keys written once, to pages of its own that each of its blocks reads; each
    # block's own keys to a page past them
    ps, dev = blk, windows.device
    per = -(-t // ps)  # pages a window spans
    s = starts.numel()
    store = drafter.context_store(bsz * per + s, ps)
    q = torch.arange(t, device=dev)
    slots = ((torch.arange(bsz, device=dev)[:, None] * per + q // ps) * ps + q % ps).reshape(-1)
    drafter.write_context(drafter.context_features(tapped.reshape(bsz * t, -1)), q.repeat(bsz), slots, store)
    rows = torch.arange(bsz, device=dev)[:, None].expand_as(starts).reshape(-1)
    p = starts.reshape(-1)
    at = p[:, None] - c_len + torch.arange(c_len, device=dev)[None, :]  # positions p - C .. p - 1
    near = at.clamp(min=0)
    context = ContextKV(store, rows[:, None] * per + near // ps, near % ps, at >= 0,
                        bsz * per + torch.arange(s, device=dev))
    draft = drafter.block_logits(windows[rows, p], p, context)         # [S, B - 1, V]
    want = logits[rows[:, None], p[:, None] + torch.arange(blk - 1, device=p.device)[None, :]]
    soft = -(want.softmax(-1) * draft.log_softmax(-1)).sum(-1)          # [S, B - 1]
    w = position_weights(blk, draft.device)
    loss = (soft * w).sum(-1).mean() / w.sum()
    agree = (draft.argmax(-1) == want.argmax(-1)).float().mean(0)
    return loss, agree


class DrafterTrainer:
    def __init__(self, opts: DrafterOptions, target, train: TokenStream):
        from beam_model.drafter_config import DrafterConfig
        from workbench.training.train import adamw

        self.opts, self.target, self.stream = opts, target, train
        torch.manual_seed(opts.seed)
        config = DrafterConfig.for_target(target.config, num_hidden_layers=opts.layers, block_size=opts.block_size)
        self.drafter = initial_drafter(config, target, seed=opts.seed, device=target.device)
        self.optimizer = adamw(self.drafter.named_parameters(), opts, target.device)
        self.generator = torch.Generator().manual_seed(opts.seed)
        use_autocast = opts.autocast if opts.autocast is not None else target.dtype == torch.bfloat16
        self.autocast = torch.bfloat16 if use_autocast else None
        self.history: list = []  # [step, loss, top-1 agreement per mask position, lr]

    def step(self, i: int) -> tuple[float, list[float]]:
        from workbench.training.train import learning_rate

        opts, drafter = self.opts, self.drafter
        lr = learning_rate(opts, i)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        w = random_windows(self.stream, opts.batch, opts.seq_len - 1, self.generator).to(drafter.device)
        tapped, logits = target_outputs(self.target, w, drafter.config.target_layer_ids)
        drafter.set_variants()  # each step's graph starts from the parameters
        starts = anchor_blocks(w, opts.anchors, opts.block_size, self.generator).to(w.device)
        with torch.autocast(w.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            loss, agree = block_loss(drafter, w, tapped, logits, starts)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(drafter.parameters()), opts.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        agree = [round(a, 4) for a in agree.tolist()]
        self.history.append([i + 1, round(loss.item(), 5), agree, lr])
        return loss.item(), agree

    def run(self, on_step=None, *, max_seconds: float | None = None):
        """Train from the step reached (0, or a loaded state's) to `opts.steps`; returns the drafter, or None
        where `max_seconds` ran out first (`state_dict` then holds where to go on from)."""
        started = time.perf_counter()
        for i in range(len(self.history), self.opts.steps):
            if max_seconds is not None and time.perf_counter() - started > max_seconds:
                return None
            loss, agree = self.step(i)
            if on_step:
                on_step(i + 1, loss, agree, time.perf_counter() - started)
        self.drafter.set_variants()
        return self.drafter

    def state_dict(self) -> dict:
        """Everything a later process needs to go on exactly as this one would: the options, the FP32
        weights, AdamW's moments, the data generator's state and the history."""
        return {"options": dataclasses.asdict(self.opts),
                "drafter": {n: p.detach().cpu() for n, p in self.drafter.named_parameters()},
                "optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state(),
                "history": self.history}

    def load_state_dict(self, state: dict) -> None:
        """Go on from `state_dict`'s; ValueError if it was trained with other options."""
        mine = dataclasses.asdict(self.opts)
        differ = sorted(k for k in mine if k != "device" and state["options"].get(k) != mine[k])
        if differ:
            raise ValueError("the saved training state was made with other options: " + ", ".join(
                f"{k} {state['options'].get(k)!r} (now {mine[k]!r})" for k in differ))
        with torch.no_grad():
            for name, p in self.drafter.named_parameters():
                p.copy_(state["drafter"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.history = list(state["history"])


# The frozen target's variants on a GPU: no gradient flows through it, so a gated kernel may stand in for
# a reference. The reference attention of a prompt attends one sequence at a time, most of a training
# step's launches at the batches training uses; `attention:triton`'s prefill takes them all at once.
GPU_TARGET_VARIANTS = {"attention": "triton"}


def frozen_target(path: str, device) -> torch.nn.Module:
    """The target checkpoint for distillation in the dtype the engine serves it in on `device` (BF16 on a
    GPU, FP32 on the CPU), on its reference points but, on a GPU, `GPU_TARGET_VARIANTS`."""
    from beam_model.model import BeamForCausalLM

    cuda = torch.device(device).type == "cuda"
    target = BeamForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    if cuda:
        target.set_variants(GPU_TARGET_VARIANTS)
    return target



def converted(drafter, dtype: torch.dtype):
    """A copy of `drafter` in `dtype` (its checkpoint's), sharing the same target."""
    from beam_model.drafter import BeamDrafter
    from beam_model.weights import _set_param

    out = BeamDrafter(drafter.config, dtype=dtype)
    out.attach(drafter.target)
    for name, p in drafter.named_parameters():
        _set_param(out, name, p.detach().to(dtype).clone())
    out.set_variants()
    return out
