"""`workbench train`: a Beam model trained from scratch on the standard library's training split.

The recipe: AdamW (decay on matrices only), linear warm-up then a cosine schedule to `min_lr_ratio` of
the peak, gradient clipping, BF16 autocast on the GPU (FP32 master weights), seeded windows. The
router's correction bias is not trained by gradient: after every step each MoE layer's bias moves by
`bias_rate` towards balance, up for the experts loaded below the layer's mean and down for those above
(DeepSeek-V3's auxiliary-loss-free balancing). The held-out stream is evaluated every `eval_every`
steps and after the last (`eval_tokens` of it; the command evaluates the saved checkpoint on all of it).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from workbench.training.data import TokenStream, random_windows
from workbench.training.evaluate import evaluate
from workbench.training.lm import RouteRecorder, window_logits
from workbench.training.models import initial_model


@dataclass
class TrainOptions:
    config: str = "beam-mini"
    steps: int = 3000
    batch: int = 32
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    bias_rate: float = 1e-3
    seed: int = 0
    eval_every: int = 250
    eval_tokens: int | None = 1 << 17   # held-out tokens per evaluation
    device: str = "cpu"
    autocast: bool | None = None         # BF16 autocast; None: on the GPU only


def learning_rate(opts: TrainOptions, step: int) -> float:
    """The peak rate after a linear warm-up, then a cosine down to min_lr_ratio of it at the last step."""
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    progress = (step - opts.warmup) / max(1, opts.steps - opts.warmup)
    return opts.lr * (opts.min_lr_ratio + (1 - opts.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def adamw(named_parameters, opts, device) -> torch.optim.AdamW:
    """AdamW over the trainable parameters at `opts`' rate and betas, weight decay on the matrices only
    (not on embeddings, norms or biases); fused on the GPU."""
    from workbench.training.models import EMBEDDINGS

    decay, rest = [], []
    for n, p in named_parameters:
        if p.requires_grad:
            (decay if p.dim() >= 2 and n not in EMBEDDINGS else rest).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": opts.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=opts.lr, betas=opts.betas,
                             fused=torch.device(device).type == "cuda")


def balance(model, loads: dict[int, torch.Tensor], rate: float) -> None:
    """Each MoE layer's correction bias one `rate` step towards even loads (sign of mean - load)."""
    with torch.no_grad():
        for layer, load in loads.items():
            bias = model.model.layers[layer].mlp.gate.e_score_correction_bias
            load = load.to(bias.device, torch.float32)
            bias.add_(rate * torch.sign(load.mean() - load))


@dataclass
class History:
    train: list = field(default_factory=list)   # [step, loss, lr]
    evals: list = field(default_factory=list)   # Evaluation dicts with "step"


class Trainer:
    def __init__(self, opts: TrainOptions, config, train: TokenStream, held_out: TokenStream):
        self.opts, self.train_stream, self.held_out = opts, train, held_out
        self.device = torch.device(opts.device)
        use_autocast = opts.autocast if opts.autocast is not None else self.device.type == "cuda"
        self.autocast = torch.bfloat16 if use_autocast else None
        torch.manual_seed(opts.seed)
        self.model = initial_model(config, seed=opts.seed, device=self.device)
        self.optimizer = adamw(self.model.named_parameters(), opts, self.device)
        self.generator = torch.Generator().manual_seed(opts.seed)
        self.recorder = RouteRecorder(self.model)
        self.history = History()

    def step(self, i: int) -> float:
        opts, model = self.opts, self.model
        lr = learning_rate(opts, i)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        w = random_windows(self.train_stream, opts.batch, opts.seq_len, self.generator).to(self.device)
        model.set_variants()
        self.recorder.attach()
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            logits = window_logits(model, w[:, :-1], cache_dtype=self.autocast)
        loss = F.cross_entropy(logits, w[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], opts.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        balance(model, self.recorder.loads(), opts.bias_rate)
        value = loss.item()
        self.history.train.append([i + 1, round(value, 5), lr])
        return value

    def evaluate(self, step: int) -> dict:
        e = evaluate(self.model, self.held_out, seq_len=self.opts.seq_len, batch=self.opts.batch,
                     max_tokens=self.opts.eval_tokens, autocast=self.autocast)
        out = {"step": step, **e.to_dict()}
        self.history.evals.append(out)
        return out

    def run(self, on_step=None, on_eval=None) -> History:
        """Every step (`on_step(step, loss, lr, seconds)`), and the evaluations (`on_eval`)."""
        started = time.perf_counter()
        for i in range(self.opts.steps):
            loss = self.step(i)
            if on_step:
                on_step(i + 1, loss, self.history.train[-1][2], time.perf_counter() - started)
            last = i + 1 == self.opts.steps
            if last or (self.opts.eval_every and (i + 1) % self.opts.eval_every == 0):
                e = self.evaluate(i + 1)
                if on_eval:
                    on_eval(e)
        return self.history
