"""Why do `route` variants fail `route_ids` at long prefills? The margins of every token they get wrong.

At 8K- and 16K-token prefills `route:triton` and `route:flashinfer` both failed the op gate on the
same token (8105 of the seed-1 inputs; runs/check-tp8-backends/). The gate says only "picks other
experts". This script makes the gate's inputs for a workload and seed (the spec's own generator, so
the same values on the same GPU), runs the reference and each variant at each tuning config, and
for every token whose ids differ from the FP32 reference's (a tie the gate accepts, or rejected) prints: both id sets, the FP64 and FP32
biased scores of the experts that differ, and the FP64 group scores, so a near-tie (a gap ~1e-6,
FP32 summation order) reads differently from a real error (a gap far above it).

    python3 scripts/gpu_route_margins.py [--preset beam-501b-tp8] [--batch 1] [--tokens 8192]
        [--seeds 1] [--variants triton flashinfer] [--device cuda]

Exit code 0 when no variant has a rejected token, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys

import torch


def rejected(call, ids) -> list[int]:
    """Tokens whose ids the gate's FP64 check rejects (route._compare's rule)."""
    from workbench.variants.route import _valid_choice

    x, w = call.args
    biased = (torch.sigmoid(x.double() @ w["weight"].double().t()) + w["bias"].double()).cpu()
    kw = {k: call.kwargs[k] for k in ("n_group", "topk_group", "top_k")}
    ids = ids.cpu()
    return [n for n in range(ids.shape[0]) if not _valid_choice(biased[n], ids[n].tolist(), **kw)]


def explain(call, n: int, got: list[int], want: list[int]) -> str:
    x, w = call.args
    kw = call.kwargs
    row = x[n:n + 1]
    b64 = (torch.sigmoid(row.double() @ w["weight"].double().t()) + w["bias"].double())[0].cpu()
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False  # FP32 as the reference
    try:
        b32 = (torch.sigmoid(row.float() @ w["weight"].float().t()) + w["bias"].float())[0].cpu()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    size = b64.numel() // kw["n_group"]
    groups = b64.view(kw["n_group"], size).topk(2, -1).values.sum(-1)
    lines = [f"  token {n}: variant {sorted(got)}  reference {sorted(want)}"]
    for e in sorted(set(got) ^ set(want)):
        side = "variant only" if e in got else "reference only"
        lines.append(f"    expert {e:4d} (group {e // size}, {side}): biased FP64 {b64[e].item():.9f}, "
                     f"FP32 {b32[e].item():.9f}")
    order = groups.argsort(descending=True).tolist()
    lines.append("    FP64 group scores (best first): "
                 + ", ".join(f"g{g} {groups[g].item():.9f}" for g in order))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="beam-501b-tp8")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=8192, help="prefill tokens per sequence")
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--variants", nargs="+", default=["triton", "flashinfer"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    from workbench.points import Workload, spec
    from workbench.registry import get

    wl = Workload(preset=args.preset, dtype="bf16").with_(batch=args.batch, tokens_per_seq=args.tokens,
                                                          context=args.tokens)
    bad = 0
    for seed in args.seeds:
        call = spec("route").make_inputs(wl, torch.device(args.device), seed)
        x, w = call.args
        want = get("route", "torch").fn(x.float(), w, **call.kwargs)[0]  # FP32 reference, as the gate's
        for name in args.variants:
            v = get("route", name)
            why = v.unsupported(wl, args.device)
            if why:
                print(f"seed {seed} {name}: skipped ({why})")
                continue
            for i, config in enumerate(v.configs or [None]):
                ids = v.at(config)(x, v.prepare_weights(w), **call.kwargs)[0]
                wrong = rejected(call, ids)
                bad += bool(wrong)
                differ = (ids.sort(-1).values != want.sort(-1).values).any(-1).nonzero().flatten().tolist()
                print(f"seed {seed} {name} config {i}: {len(differ)} token(s) differ from the FP32 reference, "
                      f"{len(wrong)} rejected, of {ids.shape[0]}")
                for n in differ[:8]:  # ties the gate accepts are shown too: their margins are the evidence
                    print(("REJECTED" if n in wrong else "accepted") + "\n"
                          + explain(call, n, ids[n].tolist(), want[n].tolist()))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
