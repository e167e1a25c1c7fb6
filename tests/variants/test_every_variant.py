"""Every registered variant, at every tuning config, through the op gate: one generic test over the
registry, so a variant added to a point package is gated without a test of its own. A variant that
cannot run here is skipped with the registry's reason (or the quarantine's); SKIP names the reason
for the rest on the CPU.

On the CPU the Triton kernels run interpreted (tests/conftest.py sets TRITON_INTERPRET), a second or
more a call, so the cases are planned to gate each config once where it runs as itself, at beam-tiny
shapes and one seed:
- every config at the first workload it runs at as itself (for most, decode of one sequence);
- the default config (a variant's first) also at every other standard workload: decode of three
  sequences and a prefill chunk, in each kind of layer the point runs in;
- LARGER holds the workloads past the standard ones where some variants and configs first run as
  themselves; they are gated there.
One case per (variant, config, workload), those past the first workload first: the slow ones spread
over the xdist workers instead of ending the run.

On the GPU (`-m gpu`) every config runs at every workload, two seeds: the standard workloads at
beam-tiny and at one tensor-parallel rank of beam-501b, and GPU_EXTRA (larger batches, long contexts
and prefills) at both presets wherever the context fits.
"""

import pytest
import torch

from workbench import gates, registry
from workbench.points import STEP_POINTS, Workload, step_kinds
from workbench.quarantine import quarantined

TINY, TP8 = "beam-tiny", "beam-501b-tp8"

# Variants this test does not run on the CPU, each with the reason (keyed "point:variant").
SKIP = {
    **{f"{p}:torch_compile": "the reference under torch.compile: tests/workbench/test_gates.py gates it at every "
       "point (test_real_variant_passes: decode, prefill and a model's captured calls)" for p in registry.POINTS},
}


def _standard(point: str, preset: str, context: int, chunk: int) -> list[Workload]:
    """Decode of one sequence and of three at `context` tokens, and a prefill chunk of `chunk` new tokens
    in each of two sequences ending at `context`, in each kind of layer the point runs in. Head and
    sample take a row per sequence, so a prefill is more rows to them, as a decode batch is: no prefill."""
    kinds = [k for k in step_kinds(point) if k != "model"] or ["sliding"]
    shapes = [dict(batch=1), dict(batch=3)]
    if point not in STEP_POINTS:
        shapes.append(dict(batch=2, tokens_per_seq=chunk))
    return [Workload(preset, layer=kind, context=context, **shape) for shape in shapes for kind in kinds]


# CPU: 20 tokens of context, past beam-tiny's 16-token window, so a sliding layer's queries (the prefill
# chunk's 2 new tokens a sequence too) leave out the first keys.
def _cpu_standard(point: str) -> list[Workload]:
    return _standard(point, TINY, 20, 2)


# Beyond the standard workloads, on the CPU: where variants or configs first run as themselves.
LARGER = {
    # 18 tokens: 72 routed pairs, past the 64 the GEMV path takes (experts:grouped_mm, experts:triton_rounded);
    # decode on quantized weights (variants that read only those formats: experts:triton_quantized), FP8 first:
    # interpreted, NVFP4's code decode is several times slower, and the quantized variants' own tests gate their
    # NVFP4 paths (test_experts_quantized*.py)
    "experts": [Workload(TINY, batch=2, tokens_per_seq=9, context=9)]
    + [Workload(TINY, context=20, weights=fmt) for fmt in ("fp8", "nvfp4")],
    # decode on FP8 weights: the *:triton_fp8 GEMVs read only that format; a prefill on them: *:fp8_scaled_mm
    **{p: [Workload(TINY, context=20, weights="fp8"), Workload(TINY, batch=2, tokens_per_seq=9, context=20,
                                                               weights="fp8")]
       for p in ("qkvg_proj", "dense_mlp", "attn_out")},
    # 98 tokens: past the 96 up to which route:triton_cublas's GEMM plans all run route:triton's default
    "route": [Workload(TINY, batch=2, tokens_per_seq=49, context=49)],
}


def _gpu_workloads(v) -> list[Workload]:
    """The standard workloads at beam-tiny (as on the CPU) and at a TP8 rank (decode at 4K of context,
    a 2 x 512 prefill), then GPU_EXTRA's at both presets where the context fits the preset. The
    reference under torch.compile compiles once a shape (seconds each): the standard workloads only."""
    standard = _cpu_standard(v.point) + _standard(v.point, TP8, 4096, 512)
    if v.backend == "torch_compile":
        return standard
    kinds = [k for k in step_kinds(v.point) if k != "model"] or ["sliding"]
    extra = [wl.with_(preset=preset, layer=kind) for preset in (TINY, TP8) for wl in GPU_EXTRA.get(v.point, [])
             for kind in kinds]
    return standard + [wl for wl in extra if wl.context <= wl.config.max_position_embeddings]


def _decode(*batches, context=4096):
    return [Workload(batch=b, context=context) for b in batches]


def _prefill(*shapes):
    return [Workload(batch=b, tokens_per_seq=t, context=ctx) for b, t, ctx in shapes]


def _fp8_decode():
    """Decode on FP8 weights, the only workloads the *:triton_fp8 GEMVs read."""
    return [wl.with_(weights="fp8") for wl in _decode(1, 8)]


def _fp8_prefill():
    """A prompt on FP8 weights: the *:fp8_scaled_mm GEMMs' sizes."""
    return [wl.with_(weights="fp8") for wl in _prefill((2, 64, 128), PROMPT)]


# GPU workloads past the standard ones, per point (the preset and layer kind are filled in). A prompt of
# 2 x 512 tokens: the library GEMMs' and grouped MoE kernels' prefill at beam-tiny too.
PROMPT = (2, 512, 512)
GPU_EXTRA = {
    "boundary": _decode(8, 64, 2048),
    # past 16 rows: the CuTe GEMV's packed GEMM
    "qkvg_proj": _decode(8, 16, 64) + _prefill((2, 64, 128), PROMPT) + _fp8_decode() + _fp8_prefill(),
    "qk_prep": _decode(8, 64),
    # 32K of context; prefill-8x2k and a chunk of 2K after 6K of context
    "attention": _decode(8, 64) + _decode(1, 8, 64, context=32768)
    + _prefill((1, 2048, 2048), (1, 8192, 8192), (8, 2048, 2048), (2, 2048, 8192)),
    "attn_out": _decode(8, 64) + _prefill(PROMPT) + _fp8_decode() + _fp8_prefill(),
    "route": _decode(8, 64, 128, 512) + _prefill(PROMPT),  # route:triton's three GEMM regimes
    "experts": _decode(8, 64) + _prefill(PROMPT, (1, 2048, 2048))
    + [wl.with_(weights=fmt) for fmt in ("fp8", "nvfp4") for wl in _decode(1, 8, 64) + _prefill(PROMPT)],  # quantized
    "dense_mlp": _decode(8, 64) + _fp8_decode() + _fp8_prefill(),
    "head": _decode(8, 64),
    "sample": _decode(8, 64),
    "attention_out": _decode(8) + _decode(1, 8, context=32768),
}


def _why_not(v, config, workload, device) -> str | None:
    """Why `v` at `config` does not run as itself at `workload` on `device`, or None."""
    return v.unsupported(workload, device) or v.unsupported_config(config, workload)


def _runs_nowhere(v, config, workloads, device) -> str:
    return f"{v.qualname} {config or ''} runs as itself at none of {[w.label() for w in workloads]}: " \
           f"{_why_not(v, config, workloads[0], device)}"


def _skipped(v, device) -> str | None:
    return (device == "cpu" and SKIP.get(v.qualname)) or v.unsupported(None, device) \
        or quarantined(v.point, v.name, device)


def _id(v, index: int) -> str:
    return v.qualname + (f"#{index}" if len(v.tuning_configs()) > 1 else "")


def _cpu_cases():
    """(point, variant, config index, workload) per case; a skipped case has no workload."""
    for point in registry.POINTS:
        standard = _cpu_standard(point)
        ladder = standard + LARGER.get(point, [])
        for v in registry.variants(point).values():
            why = _skipped(v, "cpu")
            for i, config in enumerate(v.tuning_configs()):
                if why:
                    yield pytest.param(point, v.name, i, None, id=_id(v, i), marks=pytest.mark.skip(reason=why))
                    continue
                runs = [wl for wl in ladder if _why_not(v, config, wl, "cpu") is None]
                if not runs:
                    yield pytest.param(point, v.name, i, None, id=_id(v, i),
                                       marks=pytest.mark.skip(reason=_runs_nowhere(v, config, ladder, "cpu")))
                    continue
                picked = (i == 0 and [wl for wl in standard if wl in runs]) or runs[:1]
                for wl in picked:
                    label = wl.label().removeprefix(f"{TINY} ").removesuffix(f" {wl.dtype}").replace(" ", "-")
                    yield pytest.param(point, v.name, i, wl, id=f"{_id(v, i)}-{label}")


def _heavier_first(cases: list) -> list:
    """The cases past a point's first workload (more rows, more interpreted programs) ahead of the rest."""
    first = {point: _cpu_standard(point)[0] for point in registry.POINTS}
    return sorted(cases, key=lambda case: case.values[3] in (None, first[case.values[0]]))  # stable


def _failures(report, config) -> tuple:
    return config, [(c.name, c.case, c.error, c.detail) for c in report.failures][:5]


@pytest.mark.parametrize("point, name, index, workload", _heavier_first(list(_cpu_cases())))
def test_op_gate_at_tiny_shapes(point, name, index, workload):
    v = registry.get(point, name)
    config = v.tuning_configs()[index]
    report = gates.op_gate(v, [workload], device="cpu", seeds=(0,), config=config)
    assert report.passed, _failures(report, config)


def _config_cases():
    for point in registry.POINTS:
        for v in registry.variants(point).values():
            for i in range(len(v.tuning_configs())):
                yield pytest.param(point, v.name, i, id=_id(v, i))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("point, name, index", list(_config_cases()))
def test_op_gate_on_the_gpu(point, name, index):
    v = registry.get(point, name)
    why = _skipped(v, "cuda")
    if why:
        pytest.skip(why)
    config = v.tuning_configs()[index]
    workloads = _gpu_workloads(v)
    runs = [wl for wl in workloads if _why_not(v, config, wl, "cuda") is None]
    if not runs:
        pytest.skip(_runs_nowhere(v, config, workloads, "cuda"))
    report = gates.op_gate(v, runs, device="cuda", seeds=(0, 1), config=config)
    assert report.passed, _failures(report, config)
