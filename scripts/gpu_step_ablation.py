"""How much of a lock's step would go if a point's kernels cost nothing: the lock's whole target step
against the same build with points replaced by stand-ins that launch no kernel, in one process on one
model, builds alternating (A B C ... A B C ...). An upper bound on what fusing those points into their
neighbours can save in the step as the server runs it (graphed decode, PDL between kernels), before any
fusion is written. The stand-ins compute nothing: the step's values are wrong, only its time counts.

    python3 scripts/gpu_step_ablation.py LOCK [--skip POINT[,POINT...] ...] [--rounds 2] [--out FILE]
    python3 scripts/gpu_step_ablation.py --summarize FILE REPORT.json   # the table, beside the run's floors

Each --skip is one build with those points stood in for (default: DEFAULT_SKIPS). Stand-ins: qk_prep
returns q as [N, heads, hd] (no norm, no RoPE, no KV write); boundary returns (h, y); route the same
fixed experts for every token; the others a fixed zero output of their point's shape. Writes every timing to
--out as JSON.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from gpu_step_swap import build_step, time_builds  # noqa: E402

from workbench import registry  # noqa: E402
from workbench.lock import Lock  # noqa: E402

SKIPPED = "skipped"  # the stand-ins' variant name, registered by this script only
# Each point on its own, then the kernels between the weight-streaming ones together (what fusions into
# those could remove at best), then everything but the routed experts.
DEFAULT_SKIPS = ["qkvg_proj", "qk_prep", "attention_out", "boundary", "route", "experts", "dense_mlp", "head",
                 "qk_prep,boundary,route", "qkvg_proj,qk_prep,attention_out,boundary,route,dense_mlp,head"]

# Fixed outputs, made on first use (the step runner's warm-up calls, outside graph capture) and then
# returned by every call, so a captured step holds no kernel for a stood-in point.
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
    return q.view(q.shape[0], -1, cache.shape[-1])


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


def _attention_out(q, cache, meta, g, w, *, window, scale):
    return _zeros("attention_out", q.shape[0], w["o_proj"].shape[0], q)


def _head(h, w, *, eps, softcap):
    return _zeros("head", h.shape[0], w["lm_head"].shape[0], h, torch.float32)


STAND_INS = {"qkvg_proj": _qkvg_proj, "qk_prep": _qk_prep, "attention_out": _attention_out, "boundary": _boundary,
             "route": _route, "experts": _experts, "dense_mlp": _dense_mlp, "head": _head}


def register_stand_ins() -> None:
    for point, fn in STAND_INS.items():
        if SKIPPED not in registry.variants(point):
            registry.register(point, SKIPPED, "torch")(fn)


def ablations(lock: Lock, skips: list[str]) -> dict:
    """label -> (selection, configs): the lock's build, then one build per entry of `skips`."""
    builds = {"lock": (lock.selection, lock.configs)}
    for entry in skips:
        points = entry.split(",")
        unknown = [p for p in points if p not in STAND_INS]
        if unknown:
            raise SystemExit(f"no stand-in for {unknown}; points with one: {', '.join(STAND_INS)}")
        builds[f"{'+'.join(points)} skipped"] = ({**lock.selection, **{p: SKIPPED for p in points}},
                                                 {p: c for p, c in lock.configs.items() if p not in points})
    return builds


def summarize(ablation_path: str, report_path: str) -> str:
    """A markdown table: each build's best step, what standing in for its points saved against the
    lock's step (their cost in the step as it runs), and the points' bytes-and-FLOPs floor from the
    optimize report beside it."""
    with open(ablation_path) as f:
        best = json.load(f)["best_ms"]
    with open(report_path) as f:
        floors = {p["point"]: p.get("floor_ms") or 0.0 for p in json.load(f)["points"]}
    lines = ["| stood in for | step ms | saved ms | their floor ms | saved / floor |", "| --- | ---: | ---: | ---: | ---: |",
             f"| nothing (the lock) | {best['lock']:.3f} | | | |"]
    for label, ms in best.items():
        if label == "lock":
            continue
        floor = sum(floors.get(p, 0.0) for p in label.removesuffix(" skipped").split("+"))
        saved = best["lock"] - ms
        ratio = f"{saved / floor:.2f}" if floor >= 0.01 else "-"
        lines.append(f"| {label.removesuffix(' skipped')} | {ms:.3f} | {saved:.3f} | {floor:.3f} | {ratio} |")
    singles = [label for label in best if label != "lock" and "+" not in label]
    lines.append(f"\nSum of the {len(singles)} single-point savings: "
                 f"{sum(best['lock'] - best[label] for label in singles):.3f} ms of the lock's {best['lock']:.3f} ms.")
    return "\n".join(lines)


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--summarize"]:
        print(summarize(*argv[1:3]))
        return None
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lock")
    ap.add_argument("--skip", action="append", help="points to stand in for, comma-separated (repeatable)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--preset", help="another preset than the lock's (a CPU smoke run)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    lock, problems = Lock.load(args.lock)
    if problems:
        print("lock problems (timed as written):", problems)
    register_stand_ins()
    builds = ablations(lock, args.skip or DEFAULT_SKIPS)
    runner = build_step(lock, args.preset or lock.model["preset"], args.device)
    results, best = time_builds(runner, builds, rounds=args.rounds, device=args.device)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(["scripts/gpu_step_ablation.py", *argv]),
                       "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
                       "torch": torch.__version__, "selection": lock.selection, "best_ms": best,
                       "timings": results}, f, indent=1)
    return best


if __name__ == "__main__":
    main()
