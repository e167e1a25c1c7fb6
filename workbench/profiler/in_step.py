"""What each fusion point costs in a target step as it really runs: the step timed as the server runs
it (a CUDA graph for decode, PDL between kernels), then again with one point (or a group) replaced by
a stand-in that launches no kernel. The difference is the point's cost in the step, its overlap with
its neighbours included, which an eager profile cannot show (at decode batch 1 the device sits idle
between most kernels of an eager step); it is also the most any fusion of that point into its
neighbours can save. The stand-ins compute nothing: only the steps' times mean anything.

The stand-ins are variants named `stand_in`, registered only inside `stand_ins()`, so no search,
gate or lock ever sees them. They read no weight, so they take every stored format.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from workbench import registry
from workbench.timing import time_fn

STAND_IN = "stand_in"

# Fixed outputs, made on first use (the step runner's warm-up calls, outside graph capture) and then
# returned by every call, so a captured step holds no kernel of a stood-in point.
_FIXED: dict[tuple, torch.Tensor] = {}


def _fixed(tag: str, shape: tuple, dtype: torch.dtype, device: torch.device, fill) -> torch.Tensor:
    key = (tag, shape, dtype, device)
    if key not in _FIXED:
        _FIXED[key] = fill(torch.empty(shape, dtype=dtype, device=device))
    return _FIXED[key]


def _zeros(tag: str, rows: int, width: int, like: torch.Tensor, dtype=None) -> torch.Tensor:
    return _fixed(tag, (rows, width), dtype or like.dtype, like.device, torch.Tensor.zero_)


def _qkvg_proj(x, w):
    n = x.shape[0]
    return tuple(_zeros(f"qkvg {p}", n, w[p].shape[0], x) for p in ("q_proj", "k_proj", "v_proj", "gate_proj"))


def _qk_prep(q, k, v, w, *, cache, slot_mapping, positions, eps, rope_theta=None, ssmax=None):
    return q.view(q.shape[0], -1, cache.shape[-1])  # a view: no norm, no RoPE, no KV write


def _attention_out(q, cache, meta, g, w, *, window, scale):
    return _zeros("attention_out", q.shape[0], w["o_proj"].shape[0], q)


def _boundary(y, h, w, *, eps, group=None):
    return h, (None if w["next_norm"] is None else y)


def _route(x, w, *, n_group, topk_group, top_k, scale):
    n = x.shape[0]
    ids = _fixed("route ids", (n, top_k), torch.int64, x.device,
                 lambda t: t.copy_(torch.arange(top_k, device=x.device).expand(n, top_k)))
    return ids, _fixed("route weights", (n, top_k), torch.float32, x.device, lambda t: t.fill_(1.0 / top_k))


def _experts(x, ids, weights, w):
    return _zeros("experts", x.shape[0], x.shape[1], x)


def _dense_mlp(x, w):
    return _zeros("dense_mlp", x.shape[0], x.shape[1], x)


def _head(h, w, *, eps, softcap):
    return _zeros("head", h.shape[0], w["lm_head"].shape[0], h, torch.float32)


def _sample(logits, temperature, top_k, top_p, *, generator=None):
    return _fixed("sample", (logits.shape[0],), torch.int64, logits.device, torch.Tensor.zero_)


# Every point the model calls (a compound's members run inside it: stand in for the compound).
STAND_INS = {"qkvg_proj": _qkvg_proj, "qk_prep": _qk_prep, "attention_out": _attention_out,
             "boundary": _boundary, "route": _route, "experts": _experts, "dense_mlp": _dense_mlp,
             "head": _head, "sample": _sample}


@contextmanager
def stand_ins():
    """The stand-ins registered as each point's `stand_in` variant, for the block only."""
    added = []
    try:
        for point, fn in STAND_INS.items():
            table = registry.variants(point)
            if STAND_IN not in table:
                table[STAND_IN] = registry.Variant(point, STAND_IN, "torch", fn, formats=registry.WEIGHT_FORMATS)
                added.append(table)
        yield
    finally:
        for table in added:
            del table[STAND_IN]


def check_groups(groups: list[str]) -> list[tuple[str, ...]]:
    """Groups of points as given on a command line ("route,experts"), checked: each names points with a
    stand-in."""
    out = []
    for text in groups:
        group = tuple(p.strip() for p in text.split(",") if p.strip())
        unknown = [p for p in group if p not in STAND_INS]
        if unknown or not group:
            raise ValueError(f"no stand-in for {unknown or repr(text)}: points with one: {', '.join(STAND_INS)}")
        out.append(group)
    return out


def builds(selection: dict, configs: dict, groups: list[tuple[str, ...]]) -> dict:
    """label -> (selection, configs): the build as given ("step"), then one build per group of points
    stood in for, labelled by the group ("route+experts")."""
    check_groups([",".join(g) for g in groups])
    out = {"step": (dict(selection), dict(configs))}
    for group in groups:
        out["+".join(group)] = ({**selection, **{p: STAND_IN for p in group}},
                                {p: c for p, c in configs.items() if p not in group})
    return out


def time_builds(runner, labelled: dict, *, rounds: int, device, budget_s: float, log=print) -> tuple[dict, dict]:
    """Each build (label -> (selection, configs)) bound on `runner` and timed as a whole step
    (`time_fn`, `budget_s` of samples), in turn, `rounds` times over, so the device's drift falls
    on all alike. Returns
    every timing by label and each label's best median in ms; a build that fails is logged and left
    out of the best."""
    results = {label: [] for label in labelled}
    for r in range(rounds):
        for label, (selection, configs) in labelled.items():
            try:
                runner.rebind(selection, configs)
                timing = time_fn(runner, device=device, budget_s=budget_s, max_seconds=budget_s)
            except Exception as e:
                results[label].append({"error": f"{type(e).__name__}: {e}"})
                log(f"round {r}: {label}: failed: {type(e).__name__}: {e}")
                continue
            results[label].append(timing)
            log(f"round {r}: {label}: {timing['median_us'] / 1e3:.3f} ms (spread {timing['spread']:.1%})")
    best = {label: min(x["median_us"] for x in runs if "median_us" in x) / 1e3
            for label, runs in results.items() if any("median_us" in x for x in runs)}
    return results, best


def in_step_costs(runner, selection: dict, configs: dict, *, groups: list[tuple[str, ...]] | None = None,
                  rounds: int = 2, device, budget_s: float = 2.0, log=print) -> dict:
    """The step of `selection` against it with each point the model calls stood in for, one at a time,
    then each of `groups` together; `runner` is left bound to `selection`. Returns {"step_ms", "costs":
    {label: {"step_ms", "cost_ms"}}, "timings"}."""
    groups = [(p,) for p in STAND_INS] + [tuple(g) for g in (groups or [])]
    with stand_ins():
        try:
            results, best = time_builds(runner, builds(selection, configs, groups), rounds=rounds, device=device,
                                        budget_s=budget_s, log=log)
        finally:
            runner.rebind(selection, configs)
    if "step" not in best:
        raise RuntimeError(f"the step itself failed to run: {results['step']}")
    costs = {label: {"step_ms": ms, "cost_ms": best["step"] - ms} for label, ms in best.items() if label != "step"}
    return {"step_ms": best["step"], "costs": costs, "rounds": rounds, "timings": results}
