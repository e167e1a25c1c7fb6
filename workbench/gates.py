"""Correctness gates: nothing is locked that fails one.

- `op_gate(variant, workloads)`: one variant against its point's reference, on fresh seeds and on
  real activations captured from the model (`capture_calls`). The yardstick is the reference run in
  high precision (FP64 on CPU, FP32 on CUDA, FP64 for FP32 workloads) on upcast copies of the same
  inputs, never the reference at the model dtype. (The references' explicit `.float()` steps still
  run in FP32 there: far below BF16/FP16 rounding, ~1e-7 against the FP32 tolerances.)
  Checks: it runs; output count/shape/dtype as the reference's and contiguous; finite; accurate
  (relative error per output and its worst element, or the point's own `compare`); the in-place
  cache written exactly at its slots; inputs untouched; deterministic; earlier outputs not
  overwritten by a later call; right again when the next seed's values are written into the same
  tensors (defeats results cached by pointer or by first call).
- `model_gate(selection)`: the whole build against the reference build: prompt logits, and greedy
  tokens over decode steps through the paged cache (a divergence passes only at a near-tie).

The gates never trust the candidate: uninitialised memory is poisoned during its calls, slots it
must write are pre-filled with NaN, and anything it raises becomes a failed check with the error
text. A gate must never crash on a bad candidate, never compare against the candidate's own
outputs, and never leave global torch state changed.
"""

from __future__ import annotations

import dataclasses
import math
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from workbench.dtypes import dtype_of, name_of
from workbench.points import Call, Workload, leaves, map_leaves, named_leaves, spec, step_kinds
from workbench.registry import POINTS, Variant, reference

# The whole build against the reference build at the same dtype (a full-size rank has no room for an
# FP32 twin), teacher-forced: the candidate build decodes the reference's tokens and its MoE layers
# use the reference's expert choice (docs/decisions.md, 5). Unforced, a random-weight MoE in BF16 is
# chaotic: rounding flips near-tied expert choices, each flip moves logits by O(1), and over all the
# layers a correct build ends far from the reference. Forced, what is left is smooth rounding error;
# the candidate's own routing is still computed and must agree with the reference's on most rows
# (exact routing is the route op gate's job). Sharp in FP32; in BF16 / FP16 it catches gross faults,
# precision is the op gate's job.
MODEL_TOLERANCE = {"fp32": 1e-4, "fp16": 0.15, "bf16": 0.35}
NEAR_TIE = {"fp32": 1e-3, "fp16": 0.5, "bf16": 1.5}  # reference top-2 logit gap below which tokens may differ
# Rows whose expert set must match the reference's. Correct BF16 builds agree on most rows but not
# all (among many near-uniform random experts, rounding upstream flips the last choice); a route that
# picks wrong experts agrees on almost none. Half the rows lies well between the two.
ROUTE_AGREEMENT = {"fp32": 0.99, "fp16": 0.5, "bf16": 0.5}


@dataclass
class CheckResult:
    name: str
    case: str
    passed: bool
    error: float | None = None
    threshold: float | None = None
    detail: str = ""


@dataclass
class GateReport:
    gate: str     # "op" or "model"
    subject: str  # the variant's qualname, or the selection
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.passed]

    def first_failure(self) -> str | None:
        c = next(iter(self.failures), None)
        return f"{c.name} [{c.case}] {c.detail}".strip() if c else ("no checks ran" if not self.checks else None)

    def worst(self) -> CheckResult | None:
        """The measured check closest to (or furthest past) its threshold."""
        rated = [c for c in self.checks if c.error is not None and c.threshold]
        return max(rated, key=lambda c: _ratio(c.error, c.threshold), default=None)

    def to_dict(self) -> dict:
        return {"gate": self.gate, "subject": self.subject, "passed": self.passed,
                "checks": [{k: _json_float(v) for k, v in dataclasses.asdict(c).items()} for c in self.checks]}

    @classmethod
    def from_dict(cls, d: dict) -> "GateReport":
        numbers = ("error", "threshold")  # `to_dict` writes a non-finite float as its string
        return cls(d["gate"], d["subject"], [
            CheckResult(**{k: float(v) if k in numbers and isinstance(v, str) else v for k, v in c.items()})
            for c in d["checks"]])


def _ratio(error: float, threshold: float) -> float:
    r = error / threshold
    return math.inf if math.isnan(r) else r


def _json_float(v):
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


# ---------------------------------------------------------------------------- input plumbing

def _clone_generator(g: torch.Generator) -> torch.Generator:
    clone = torch.Generator(device=g.device)
    clone.set_state(g.get_state())
    return clone


def _copy(call: Call, dtype=None) -> Call:
    """A copy of a call with floating tensors cast to `dtype` (ints and metadata kept as they are)."""
    def cast(t):
        with torch.inference_mode(False):  # captured tensors may be inference tensors
            t = t.detach().clone()
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return map_leaves(call, cast, _clone_generator)


def _activations(call: Call) -> list:
    """Leaves of every argument but the weights dict."""
    args = [a for i, a in enumerate(call.args) if i != call.weights_arg]
    return leaves(args) + leaves(call.kwargs)


def _outputs(out) -> list:
    if isinstance(out, (tuple, list)):
        return list(out)
    return [out]


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Compare floats as integers: NaN == NaN and -0.0 != 0.0, i.e. bit-for-bit.
    if t.is_floating_point():
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def same_bits(a, b) -> bool:
    """Two outputs (tensors or None) equal bit for bit, shape and dtype included."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double().to(out.device)
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()


# Raised whenever a check is added, tightened or relaxed: a search result cached under an older version
# has its choice and its gate failures gated again before it is reused (workbench.search;
# docs/decisions.md, 4).
GATE_VERSION = 4

# An element may be off by ELEMENT_FACTOR x the point's tolerance of (its size + its scale). The
# relative error is a norm over the whole output: at 16K x 5120 one wrong 16-byte vector, or a token row
# a kernel dropped, moves it by ~1e-3 and passes; bf16 rounding and summation order stay ~10x inside this.
# Its scale is the larger of its row's RMS (the last dimension: a token's hidden vector, a head) and the
# whole output's: rows can differ in size by far more than rounding does (a full-attention prefill's
# first tokens average a few values, its last thousands; docs/decisions.md, 3), and a row's rounding
# error scales with the row.
ELEMENT_FACTOR = 8.0


def _worst_element(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    """max |out - ref| / (|ref| + scale) over the elements, and where (NaN anywhere: NaN); scale: the
    larger of the element's row RMS and the output's RMS."""
    out, ref = out.double(), ref.double().to(out.device)
    if out.numel() == 0:
        return 0.0, ()
    scale = ref.square().mean().sqrt()
    if ref.dim() > 1:
        scale = torch.maximum(ref.square().mean(-1, keepdim=True).sqrt(), scale)
    scaled = (out - ref).abs() / (ref.abs() + scale).clamp(min=1e-30)
    if scaled.isnan().any():
        return math.nan, ()
    flat = int(scaled.argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), scaled.shape))
    return scaled.flatten()[flat].item(), where


def _clone_all(outs: list) -> list:
    return [o.detach().clone() if isinstance(o, torch.Tensor) else o for o in outs]


def _error_text(e: BaseException) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    loc = f" (at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})" if where else ""
    return f"{type(e).__name__}: {e}{loc}"[:500]


@contextmanager
def _poisoned():
    """Uninitialised memory (torch.empty and friends) reads NaN / max-int while the candidate runs."""
    import torch.utils.deterministic as det

    was, warn_only, fill = (torch.are_deterministic_algorithms_enabled(),
                            torch.is_deterministic_algorithms_warn_only_enabled(), det.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # warn_only: ops without a deterministic kernel still run
            yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
        det.fill_uninitialized_memory = fill


@contextmanager
def _exact_matmul():
    """FP32 GEMMs in full FP32 (no TF32) for the high-precision reference."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _hp_dtype(device: torch.device, dtype: str) -> torch.dtype:
    return torch.float64 if device.type == "cpu" or dtype == "fp32" else torch.float32


# ---------------------------------------------------------------------------- op gate

@dataclass
class CapturedCall(Call):
    """A call recorded from a real model forward: `workload` describes it (dtype, layer kind)."""

    layer: int = -1
    label: str = ""
    workload: Workload | None = None


@dataclass
class _Case:
    label: str
    workload: Workload
    call: Call
    next_call: Call | None = None  # the next seed's inputs, same layout: the stale-result check


def op_gate(variant: Variant, workloads, *, device="cpu", seeds=(0, 1, 2), captured=None,
            config: dict | None = None) -> GateReport:
    """Gate one variant (at a tuning `config`, if given) on every workload x seed, plus captured calls
    (a list of CapturedCall, or capture_calls' dict). The fresh-inputs check refills the activations
    (the cache included) with the next seed's values and keeps the weights: they are load-time
    constants a variant may have transformed in `prepare`."""
    device = torch.device(device)
    report = GateReport("op", variant.qualname + (f" {config}" if config else ""))
    if config:
        variant = dataclasses.replace(variant, fn=variant.at(config))
    point_spec = spec(variant.point)
    if isinstance(captured, dict):
        captured = captured.get(variant.point, [])
    for wl in workloads:
        for seed in seeds:
            label = f"{wl.label()} seed{seed}"
            try:
                case = _Case(label, wl, point_spec.make_inputs(wl, device, seed),
                             point_spec.make_inputs(wl, device, seed + 1))
            except Exception as e:  # a harness problem, but reported like any other failure
                report.checks.append(CheckResult("inputs", label, False, detail=_error_text(e)))
                continue
            report.checks += _run_case(variant, point_spec, case, device)
    for call in captured or []:
        case = _Case(f"captured:{call.label or call.layer}", call.workload, _copy(call))
        report.checks += _run_case(variant, point_spec, case, device)
    return report


def _snapshot(leaves) -> list:
    """A copy of each named leaf: tensors cloned, generators' states."""
    return [t.clone() if isinstance(t, torch.Tensor) else t.get_state() for _, t in leaves]


def _invoke(variant: Variant, call: Call, weights) -> list:
    with _poisoned(), torch.no_grad():
        return _outputs(variant.fn(*call.with_weights(weights).args, **call.kwargs))


def _reference(point: str, call: Call, dtype, device) -> tuple[list, dict]:
    """The reference on a copy of `call` cast to `dtype`: (outputs, the in-place args after the call)."""
    c = _copy(call, dtype)
    with _exact_matmul(), torch.no_grad():
        out = _outputs(reference(point).fn(*c.args, **c.kwargs))
    return out, c.kwargs


def _run_case(variant: Variant, point_spec, case: _Case, device) -> list[CheckResult]:
    checks: list[CheckResult] = []
    call, wl, point = case.call, case.workload, variant.point

    def check(name, passed, error=None, threshold=None, detail=""):
        checks.append(CheckResult(name, case.label, bool(passed), error, threshold, detail))

    try:
        tol = point_spec.tolerance_for(wl.dtype, variant.activations, wl.weights)
    except ValueError as e:
        check("tolerance", False, detail=str(e))
        return checks
    hp = _hp_dtype(device, wl.dtype)
    inplace = [k for k in point_spec.inplace if isinstance(call.kwargs.get(k), torch.Tensor)]
    # Snapshot of every input before the weight-layout transform, which may re-lay the weights it is
    # given in place (experts:quack_gated) but must keep their values: the model's other readers see them.
    inputs = named_leaves(call.args, "args") + named_leaves(call.kwargs, "kwargs")
    before = _snapshot(inputs)
    try:
        weights = variant.prepare_weights(call.args[call.weights_arg]) if call.weights_arg is not None else None
    except Exception as e:
        check("runs", False, detail="prepare_weights raised " + _error_text(e))
        return checks
    try:
        # Which elements the call must write: the reference run on a cache that is all NaN.
        probe = Call(call.args, {**call.kwargs, **{k: torch.full_like(call.kwargs[k], math.nan) for k in inplace}},
                     call.weights_arg)
        written = {k: ~torch.isnan(v) for k, v in _reference(point, probe, hp, device)[1].items() if k in inplace}
        for k in inplace:
            call.kwargs[k][written[k]] = math.nan  # so a slot the candidate skips stays NaN
        ref, ref_inplace = _reference(point, call, hp, device)
        ref_lo, _ = _reference(point, call, None, device)
    except Exception as e:
        check("reference", False, detail="the reference failed on these inputs: " + _error_text(e))
        return checks
    if call.weights_arg is not None and weights is not call.args[call.weights_arg]:  # as the candidate gets them
        prepared = named_leaves(weights, "prepared weights")
        inputs += prepared
        before += _snapshot(prepared)
    pre_inplace = {k: call.kwargs[k].clone() for k in inplace}

    def restore():  # in-place args back to their pre-call state, generators rewound
        for k in inplace:
            call.kwargs[k].copy_(pre_inplace[k])
        for (_, t), b in zip(inputs, before):
            if isinstance(t, torch.Generator):
                t.set_state(b)

    try:
        out1_raw = _invoke(variant, call, weights)
    except Exception as e:
        check("runs", False, detail=_error_text(e))
        return checks
    out1 = _clone_all(out1_raw)
    after1 = {k: call.kwargs[k].clone() for k in inplace}
    check("runs", True)

    # Inputs: everything but the declared in-place args (and generators, whose state must advance).
    changed = [name for (name, t), b in zip(inputs, before)
               if isinstance(t, torch.Tensor) and not any(t is call.kwargs[k] for k in inplace) and not same_bits(t, b)]
    check("inputs_unchanged", not changed, detail=f"modified in place: {', '.join(changed)}" if changed else "")

    sig_ok = len(out1) == len(ref_lo) and all(
        (o is None) == (r is None) and (r is None or (isinstance(o, torch.Tensor) and o.shape == r.shape
                                                      and o.dtype == r.dtype and o.device == r.device))
        for o, r in zip(out1, ref_lo))
    check("signature", sig_ok, detail="" if sig_ok else f"outputs {_describe(out1)}, reference {_describe(ref_lo)}")
    if not sig_ok:
        return checks
    tensors = [o for o in out1 if o is not None]
    check("contiguous", all(o.is_contiguous() for o in tensors),
          detail="" if all(o.is_contiguous() for o in tensors) else f"strides {[o.stride() for o in tensors]}")
    bad = [i for i, o in enumerate(out1) if o is not None and o.is_floating_point() and not torch.isfinite(o).all()]
    bad += [k for k in inplace if not torch.isfinite(after1[k][written[k]]).all()]
    check("finite", not bad, detail=f"NaN/Inf in output(s) {bad}: unwritten or overflowed elements" if bad else "")
    for k in inplace:
        outside = ~written[k]
        same = torch.equal(_bits(after1[k][outside]), _bits(pre_inplace[k][outside]))
        check("inplace_bounds", same, detail="" if same else
              f"{int((_bits(after1[k]) != _bits(pre_inplace[k]))[outside].sum())} elements of {k!r} changed "
              "outside the slots the call must write")

    def run_more(sub: Call) -> list:  # extra draws for statistical comparisons
        return _invoke(variant, sub, variant.prepare_weights(sub.args[sub.weights_arg])
                       if sub.weights_arg is not None else None)

    try:
        for name, error, threshold, passed, detail in _judge(point_spec, call, out1, ref, after1, ref_inplace,
                                                             written, tol, run_more):
            check(name, passed, error, threshold, detail)
    except Exception as e:  # a comparison choking on the outputs, or a statistical redraw that raised
        check("accuracy", False, detail=_error_text(e))

    restore()
    try:
        out2 = _invoke(variant, call, weights)
        same = all(same_bits(a, b) for a, b in zip(out1, out2)) and len(out1) == len(out2)
        same_inplace = all(same_bits(call.kwargs[k], after1[k]) for k in inplace)
        check("deterministic", same and same_inplace,
              detail="" if same and same_inplace else "two calls on identical inputs gave different bits")
        kept = all(same_bits(a, b) for a, b in zip(out1_raw, out1))
        check("outputs_kept", kept, detail="" if kept else "a later call overwrote an earlier call's outputs")
    except Exception as e:
        check("deterministic", False, detail="second call raised " + _error_text(e))

    if case.next_call is not None:
        checks.append(_fresh_inputs(variant, point_spec, case, weights, inplace, written, hp, device, tol))
    return checks


def _fresh_inputs(variant, point_spec, case, weights, inplace, written, hp, device, tol) -> CheckResult:
    """Write the next seed's activations into the same tensors (same addresses) and call again."""
    call = case.call
    try:
        for dst, src in zip(_activations(call), _activations(case.next_call)):
            if isinstance(dst, torch.Generator):
                dst.set_state(src.get_state())
            else:
                dst.copy_(src)
        for k in inplace:
            call.kwargs[k][written[k]] = math.nan
        ref, ref_inplace = _reference(variant.point, call, hp, device)
        out = _invoke(variant, call, weights)
        after = {k: call.kwargs[k].clone() for k in inplace}
        results = _judge(point_spec, call, out, ref, after, ref_inplace, written, tol, None)
    except Exception as e:
        return CheckResult("fresh_inputs", case.label, False, detail=_error_text(e))
    failed = [r for r in results if not r[3]]
    rated = [r for r in results if r[1] is not None and r[2]]
    worst = max(rated, key=lambda r: _ratio(r[1], r[2]), default=(None, None, None))
    return CheckResult("fresh_inputs", case.label, bool(results) and not failed, worst[1], worst[2],
                       "; ".join(f"{r[0]}: {r[4]}" for r in failed) or "right on the next seed's values, same tensors")


def _judge(point_spec, call, out, ref, after, ref_inplace, written, tol, run) -> list[tuple]:
    """(name, error, threshold, passed, detail) per accuracy check: the point's compare, else rel. error."""
    if point_spec.compare is not None:
        return point_spec.compare(call, out, ref, tol, run)
    results = []
    pairs = [(o, r, f"output {i}") for i, (o, r) in enumerate(zip(out, ref)) if o is not None and r is not None]
    pairs += [(after[k][w], ref_inplace[k][w], f"{k} at its written slots") for k, w in written.items()]
    for o, r, what in pairs:
        err = _rel_err(o, r)
        results.append(("accuracy", err, tol, err <= tol, what))
        worst, where = _worst_element(o, r)
        results.append(("accuracy", worst, ELEMENT_FACTOR * tol, worst <= ELEMENT_FACTOR * tol,
                        f"{what}, worst element {list(where)} (error / (|ref| + row or output RMS))"))
    return results


def _describe(outs: list) -> str:
    return str([None if o is None else (tuple(o.shape), str(o.dtype).replace("torch.", ""))
                if isinstance(o, torch.Tensor) else type(o).__name__ for o in outs])


# ---------------------------------------------------------------------------- captured calls

def _layer_of(config, point: str, i: int) -> tuple[int, str]:
    """(layer, label) of the i-th call of `point` in one forward."""
    if point in ("qkvg_proj", "qk_prep", "attention", "attn_out", "dense_mlp"):
        return i, f"L{i}"
    if point == "boundary":
        return i // 2, f"L{i // 2}.{'attn' if i % 2 == 0 else 'mlp'}"
    if point in ("route", "experts"):
        return config.moe_layers[i], f"L{config.moe_layers[i]}"
    return -1, point


def capture_calls(model, input_ids: torch.Tensor, points=POINTS) -> dict[str, list[CapturedCall]]:
    """Record real calls of each point during `model(input_ids)`: those of the first sliding layer,
    the first full layer and the last layer (whose boundary has no next norm). The model must be
    bound to the reference variants so the recorded weights are in the plain layout."""
    from beam_model.config import SLIDING

    c, ops = model.config, model.ops
    prepared = [p for p in points if ops.variants[p].prepare is not None]
    if prepared:
        raise ValueError(f"capture_calls needs a model bound to plain-layout variants; {prepared} transform weights")
    keep = {c.sliding_layers[0], c.full_attention_layers[0], c.num_hidden_layers - 1, -1}
    dtype = name_of(model.dtype)
    n = input_ids.numel()
    batch = input_ids.shape[0] if input_ids.dim() == 2 else 1
    out: dict[str, list[CapturedCall]] = {p: [] for p in points}
    counts = dict.fromkeys(points, 0)
    originals = {p: getattr(ops, p) for p in points}

    def recorder(point):
        def record(*args, **kwargs):
            layer, label = _layer_of(c, point, counts[point])
            counts[point] += 1
            if layer in keep:
                kind = "sliding" if layer >= 0 and c.layer_types[layer] == SLIDING else "full"
                wl = Workload(preset=c.preset or "model", batch=batch, tokens_per_seq=n // batch,
                              context=n // batch, layer=kind, dtype=dtype, weights=model.weights)
                weights_arg = next((i for i, a in enumerate(args) if isinstance(a, dict)), None)
                call = Call(args, kwargs, weights_arg)
                # Activations are copied (the cache changes later); weights are parameters: referenced.
                copy = _copy(call.with_weights({})).with_weights(args[weights_arg]) if weights_arg is not None \
                    else _copy(call)
                out[point].append(CapturedCall(copy.args, copy.kwargs, weights_arg, layer, label, wl))
            return originals[point](*args, **kwargs)
        return record

    try:
        for p in points:
            setattr(ops, p, recorder(p))
        model(input_ids)
    finally:
        for p in points:
            setattr(ops, p, originals[p])
    return out


# ---------------------------------------------------------------------------- model gate

@torch.inference_mode()
def _greedy(model, prompts: list[torch.Tensor], steps: int, forced: list[torch.Tensor] | None = None):
    """Prefill the prompts in one ragged step, then greedy decode: (prompt logits, [step logits], [tokens]).
    With `forced` (another run's tokens) each step is fed those tokens instead of its own choice."""
    from beam_model.kv_cache import PagedKVCache

    cache = PagedKVCache.for_sequences(model.config, [len(p) + steps + 1 for p in prompts],
                                       dtype=model.dtype, device=model.device)
    seqs = list(range(len(prompts)))
    for s in seqs:
        cache.add(s)
    step = cache.prepare_step(seqs, [len(p) for p in prompts])
    prompt_logits = model.step(torch.cat(prompts), cache, step, all_logits=True)
    logits = [prompt_logits[step.last_token_index]]
    tokens = [logits[-1].argmax(-1)]
    for i in range(steps):
        step = cache.prepare_step(seqs, [1] * len(seqs))
        logits.append(model.step(tokens[-1] if forced is None else forced[i], cache, step))
        tokens.append(logits[-1].argmax(-1))
    return prompt_logits, logits, tokens


@contextmanager
def _routing(model, recorded: list, agreement: list | None = None):
    """Record the build's expert choices (agreement None), or compute them and use `recorded` instead,
    counting [matching rows, rows] in `agreement`."""
    ops, own = model.ops, model.ops.route
    calls = iter(range(len(recorded))) if agreement is not None else None

    def route(x, w, **kw):
        ids, weights = own(x, w, **kw)
        if calls is None:
            recorded.append((ids.clone(), weights.clone()))
            return ids, weights
        ref_ids, ref_weights = recorded[next(calls)]
        agreement[0] += int((ids.sort(-1).values == ref_ids.sort(-1).values).all(-1).sum())
        agreement[1] += ids.shape[0]
        return ref_ids, ref_weights

    ops.route = route
    try:
        yield
    finally:
        ops.route = own


def ragged_lengths(longer: int) -> tuple[int, int]:
    """The model gate's two prompt lengths: ragged, since a batch of one (or of equal lengths) would hide
    cross-sequence mix-ups."""
    return longer, max(1, (2 * longer) // 3)


def model_gate(selection, *more, configs: dict | None = None, preset: str = "beam-tiny", dtype: str | None = None,
               device="cpu", prompt_len: int = 24, decode_steps: int = 8, seed: int = 0,
               weights: str = "bf16", prompts: tuple[list[torch.Tensor], str] | None = None) -> GateReport:
    """The build `selection` (at tuning `configs`) against the reference build, on one model whose
    variants are switched, so a full-size rank needs room for one copy of the weights. Builds the
    preset's model (`dtype`, default bf16) or, called as `model_gate(model, selection)`, uses that
    built model at its own dtype and device and restores its variants afterwards. The prompts are two
    ragged sequences of random ids, or `prompts`: (token id tensors, what they are, e.g. "text")."""
    from beam_model.model import BeamForCausalLM

    given = isinstance(selection, torch.nn.Module)
    if given:
        model, selection = selection, (more[0] if more else None)
        dtype = name_of(model.dtype)
        preset, restore = model.config.preset, (model.ops.selection, getattr(model.ops, "configs", None))
    else:
        dtype = dtype or "bf16"
        model = BeamForCausalLM.from_preset(preset, seed=seed, dtype=dtype_of(dtype), device=device, weights=weights)
    selection = dict(selection or {})
    subject = ", ".join(f"{p}:{v}" for p, v in sorted(selection.items())) or "reference"
    report = GateReport("model", subject)
    weights = "" if model.weights == "bf16" else f" {model.weights} weights"
    if prompts is None:
        gen = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in ragged_lengths(prompt_len)]
        case = f"{preset} {dtype}{weights} prompt{prompt_len} decode{decode_steps} seed{seed}"
    else:
        prompts, source = prompts
        lengths = ",".join(str(len(p)) for p in prompts)
        case = f"{preset} {dtype}{weights} {source} prompts {lengths} decode{decode_steps}"
    prompts = [p.to(model.device) for p in prompts]

    def check(name, passed, error=None, threshold=None, detail=""):
        report.checks.append(CheckResult(name, case, bool(passed), error, threshold, detail))

    try:
        return _model_gate(model, selection, configs, prompts, decode_steps, dtype, check, report)
    finally:
        if given:
            model.set_variants(*restore)


def _model_gate(model, selection, configs, prompts, decode_steps, dtype, check, report) -> GateReport:
    model.set_variants(None)
    routes, agreement = [], [0, 0]
    with _routing(model, routes):
        ref = _greedy(model, prompts, decode_steps)
    try:
        model.set_variants(selection, configs)
        with _poisoned(), _routing(model, routes, agreement):
            got = _greedy(model, prompts, decode_steps, forced=ref[2][:-1])
    except Exception as e:
        check("runs", False, detail=_error_text(e))
        return report
    check("runs", True)
    tol = MODEL_TOLERANCE[dtype]
    finite = all(torch.isfinite(t).all() for t in [got[0], *got[1]])
    check("finite", finite, detail="" if finite else "NaN/Inf in the logits")
    err = _rel_err(got[0], ref[0])
    check("prompt_logits", err <= tol, err, tol)
    if agreement[1]:
        share = agreement[0] / agreement[1]
        check("routing", share >= ROUTE_AGREEMENT[dtype], share, ROUTE_AGREEMENT[dtype],
              f"{agreement[0]} of {agreement[1]} routed rows chose the reference's experts")

    ref_tokens, got_tokens = torch.stack(ref[2]).cpu(), torch.stack(got[2]).cpu()  # [steps+1, B]
    diverged, ties = [], []
    for b in range(len(prompts)):
        for t in range(ref_tokens.shape[0]):  # every step saw the reference's tokens: each compares alone
            if ref_tokens[t, b] != got_tokens[t, b]:
                top2 = ref[1][t][b].float().topk(2).values
                gap = (top2[0] - top2[1]).item()
                (ties if gap < NEAR_TIE[dtype] else diverged).append(f"seq {b} step {t} (top-2 gap {gap:.3g})")
    err = _rel_err(torch.stack(got[1]), torch.stack(ref[1]))
    check("decode_logits", err <= tol, err, tol, f"{len(got[1])} steps x {len(prompts)} sequences")
    check("greedy_tokens", not diverged, len(diverged), 0,
          "; ".join([f"diverged at {d}" for d in diverged] + [f"near-tie divergence at {t}" for t in ties])
          or f"{ref_tokens.numel()} tokens identical")
    return report


# ---------------------------------------------------------------------------- lock verification

def lock_gates(lock, *, device=None) -> dict[str, dict]:
    """Re-run the gates behind a lock: the op gate of every non-reference point at the lock target's
    shapes (shrunk on CPU), and the model gate where the preset is small enough to build here.
    Keyed by point, plus "model"; each {"passed", "failed" (the first failing check), "report"}."""
    from beam_model.config import BeamConfig
    from workbench.registry import REFERENCE, get
    from workbench.targets import for_device, get_target

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    preset, dtype = lock.model.get("preset", "beam-tiny"), lock.model.get("dtype", "bf16")
    weights = lock.model.get("weights", "bf16")
    target = for_device(get_target(lock.target), device)
    results = {}
    for point, entry in lock.points.items():
        if entry["variant"] == REFERENCE:
            continue
        report = op_gate(get(point, entry["variant"]),
                         [target.workload(preset, dtype, k, weights) for k in step_kinds(point)],
                         device=device, config=entry.get("config"))
        results[point] = {"passed": report.passed, "failed": report.first_failure(), "report": report.to_dict()}
    if BeamConfig.from_preset(preset).num_parameters < 5e9:  # a full-size rank is the optimize run's to gate
        report = model_gate(lock.selection, configs=lock.configs, preset=preset, dtype=dtype, device=device,
                            weights=weights)
        results["model"] = {"passed": report.passed, "failed": report.first_failure(), "report": report.to_dict()}
    return results
