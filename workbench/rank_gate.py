"""The rank gate: a point that all-reduces, run as `world` processes of one torch.distributed group.

A point whose spec names a `partial_sum` argument (`boundary`'s y: each rank's share of a sub-layer's
output under tensor parallelism) is called with a `group` and must all-reduce that argument first. One
process never exercises it (`group` is None there), so the op gate cannot see a variant that skips
the all-reduce, sums twice, or lets the ranks disagree. Here `world` spawned ranks (gloo on the CPU;
on CUDA, NCCL with a GPU per rank, else gloo with every rank on the one GPU) each call the variant on
their own partial sum and the same other inputs. Checks per case:
- runs: every rank returns, within the time limit (a rank left waiting in a collective the others
  skipped is a failure with that reason, never a hang);
- accuracy: each rank's outputs against the reference in high precision, fed the partial sums added
  in the model dtype (the contract's all-reduce), at the point's tolerance;
- ranks agree: every rank's outputs bit for bit rank 0's (the residual stream is replicated: ranks
  that drift apart route and decode differently);
- inputs unchanged: no rank's partial sum written (an in-place all-reduce clobbers the sub-layer's
  output, which the contract keeps).

The variant reaches the ranks (`workbench.multirank`) as a picklable `load_variant()` (a registered one:
`registered(point, name)`), since spawned processes import it afresh.
"""

from __future__ import annotations

import functools

import torch

from workbench import gates
from workbench.gates import CheckResult, GateReport
from workbench.multirank import run_ranks
from workbench.points import Call, map_leaves, spec
from workbench.registry import get, variants

DEFAULT_WORLD = 2
DEFAULT_TIMEOUT_S = 120.0  # the ranks' start-up (each imports torch) and every case


def registered(point: str, name: str):
    """A picklable loader of a registered variant, for `rank_gate`: a plugin variant's ranks load its file
    first (the process that asks already runs plugin code: an isolated worker)."""
    from workbench.agent.plugins import plugin_file

    return functools.partial(_load_registered, point, name, plugin_file(get(point, name)))


def _load_registered(point: str, name: str, file: str | None):
    if file and name not in variants(point):  # a spawned rank: a fresh registry
        from workbench.agent.plugins import load_file

        load_file(file)
    return get(point, name)


def all_reduces(point: str) -> bool:
    """Whether `point`'s contract all-reduces an argument under tensor parallelism."""
    return spec(point).partial_sum is not None


def rank_gate(load_variant, workloads, *, world: int = DEFAULT_WORLD, device="cpu", seeds=(0, 1),
              config: dict | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> GateReport:
    """Gate the variant `load_variant()` returns (at a tuning `config`, if given) on `world` ranks at
    every workload x seed. Never raises for the variant's faults: they are failed checks."""
    variant = load_variant()
    device = torch.device(device)
    report = GateReport("rank", f"{variant.qualname} on {world} ranks" + (f" {config}" if config else ""))
    point_spec = spec(variant.point)
    if point_spec.partial_sum is None:
        raise ValueError(f"{variant.point} does not all-reduce: the rank gate has nothing to check")
    cases = []
    for wl in workloads:
        for seed in seeds:
            label = f"{wl.label()} seed{seed} world{world}"
            try:
                cases.append((label, wl, *_case(point_spec, wl, seed, world)))
            except Exception as e:  # a harness problem, but reported like any other failure
                report.checks.append(CheckResult("inputs", label, False, detail=gates._error_text(e)))
    if not cases:
        return report
    ranks = run_ranks(_rank_cases, world, device_type=device.type, timeout_s=timeout_s,
                      args=(load_variant, config, [(c[0], c[2], c[3]) for c in cases]))
    for i, (label, wl, call, partials) in enumerate(cases):
        per_rank = [(r.value[i] if r.value is not None else None, r.error) for r in ranks]
        report.checks += _judge_case(point_spec, per_rank, label, wl, call, partials)
    return report


def _case(point_spec, wl, seed: int, world: int) -> tuple[Call, list[torch.Tensor]]:
    """One case's shared inputs (on the CPU) and each rank's partial sum (`PointSpec.rank_inputs`)."""
    call = point_spec.make_inputs(wl, "cpu", seed)
    k = point_spec.partial_sum
    return call, [call.args[k]] + [point_spec.rank_inputs(wl, "cpu", seed, r).args[k] for r in range(1, world)]


def _with_partial(call: Call, k: int, partial: torch.Tensor) -> Call:
    args = list(call.args)
    args[k] = partial
    return Call(tuple(args), dict(call.kwargs), call.weights_arg)


# ------------------------------------------------------------------------------ the ranks

def _rank_cases(rank, world, device, load_variant, config, cases) -> list[dict]:
    """On one rank (`workbench.multirank`): every case's outputs, or the error it raised."""
    import torch.distributed as dist

    variant = load_variant()
    fn = variant.at(config) if config else variant.fn
    k = spec(variant.point).partial_sum
    results = []
    for _, call, partials in cases:
        call = map_leaves(_with_partial(call, k, partials[rank]), lambda t: t.to(device))
        mine = call.args[k].clone()
        try:
            weights = variant.prepare_weights(call.args[call.weights_arg]) if call.weights_arg is not None else None
            c = call.with_weights(weights)
            with gates._poisoned(), torch.no_grad():
                outs = gates._outputs(fn(*c.args, **{**c.kwargs, "group": dist.group.WORLD}))
            if device.type == "cuda":
                torch.cuda.synchronize()
            results.append({"outputs": [o.cpu() if isinstance(o, torch.Tensor) else o for o in outs],
                            "partial_unchanged": gates.same_bits(call.args[k], mine)})
        except Exception as e:  # noqa: BLE001 - the variant's fault, reported per case
            results.append({"error": gates._error_text(e)})
    return results


# ------------------------------------------------------------------------------ the verdict

def _judge_case(point_spec, per_rank, label, wl, call, partials) -> list[CheckResult]:
    """The checks of one case from each rank's (result or None, how it ended)."""
    checks: list[CheckResult] = []

    def check(name, passed, error=None, threshold=None, detail=""):
        checks.append(CheckResult(name, label, bool(passed), error, threshold, detail))

    failed = [f"rank {r}: {result['error']}" if result else ended or f"rank {r} left no result"
              for r, (result, ended) in enumerate(per_rank) if not result or "error" in result]
    if failed:
        check("runs", False, detail="; ".join(failed))
        return checks
    check("runs", True)
    k = point_spec.partial_sum
    total = partials[0].clone()
    for p in partials[1:]:
        total += p  # in the model dtype, as the all-reduce adds
    try:
        ref, _ = gates._reference(point_spec.name, _with_partial(call, k, total),
                                  gates._hp_dtype(torch.device("cpu"), wl.dtype), torch.device("cpu"))
    except Exception as e:  # noqa: BLE001
        check("reference", False, detail="the reference failed on these inputs: " + gates._error_text(e))
        return checks
    tol = point_spec.tolerance[wl.dtype]
    first = per_rank[0][0]["outputs"]
    for r, (result, _) in enumerate(per_rank):
        outs = result["outputs"]
        try:
            for name, err, thr, ok, detail in gates._judge(point_spec, call, outs, ref, {}, {}, {}, tol, None):
                check(name, ok, err, thr, f"rank {r}: {detail}")
        except Exception as e:  # noqa: BLE001 - wrong output count, shapes or types
            check("accuracy", False, detail=f"rank {r}: outputs {gates._describe(outs)} vs the reference's "
                  f"{gates._describe(ref)}: " + gates._error_text(e))
        if r:
            agree = len(outs) == len(first) and all(gates.same_bits(a, b) for a, b in zip(outs, first))
            check("ranks agree", agree, detail="" if agree else f"rank {r}'s outputs differ from rank 0's")
        check("inputs unchanged", result["partial_unchanged"],
              detail="" if result["partial_unchanged"] else f"rank {r}'s partial sum (argument {k}) was written")
    return checks
