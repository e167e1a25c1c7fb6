"""The torch.compile baselines of the optimize report: the step built with torch.compile, timed end to end.

"points": every point's `torch_compile` variant (each point's reference compiled); a torch.compile
mode ("default", "max-autotune-no-cudagraphs"): the whole reference step compiled in that mode;
"plain-" and a mode: the whole step compiled in that mode, built from each point's fastest plain-PyTorch
variant that passed its gate in the search (a packed projection where one was faster than the reference's
four), as a careful user writes the model before compiling it. Each is a row of the report beside the
locked build. A baseline that cannot be built is a row saying why, never a reason not to write the lock.

What it must never do: choose or lock anything, or time a build in another way than the end-to-end
stage does (`EndToEnd.time_build`).
"""

from __future__ import annotations

import traceback

import torch

from workbench import timing
from workbench.compiled import compiled
from workbench.events import StageStarted
from workbench.registry import POINTS, REFERENCE, get
from workbench.run_folder import RunFolder
from workbench.search_results import CandidateResult
from workbench.timing import describe_error

POINTS_MODE = "points"  # every point's torch_compile variant
PLAIN = "plain-"  # "plain-MODE": the step of the fastest gated plain-PyTorch variants, compiled whole in MODE


def after_search(mode: str) -> bool:
    """Whether a baseline is built from the search's results (timed at the end-to-end stage), not from
    the reference step alone (timed before the search)."""
    return mode == POINTS_MODE or mode.startswith(PLAIN)


def plain_choices(results: dict) -> dict[str, CandidateResult]:
    """Each searched point's fastest plain-PyTorch candidate (backend "torch") that passed its gate and was
    timed faster than the point's reference; a point with none keeps its reference."""
    out = {}
    for point, r in results.items():
        plain = [c for c in r.candidates if c.backend == "torch" and c.gate_passed and c.step_us is not None]
        best = min(plain, key=lambda c: c.step_us, default=None)
        if best is not None and best.step_us < r.reference_us and best.variant != REFERENCE:
            out[point] = best
    return out


def whole_step_baselines(stage, modes: tuple[str, ...], key: dict, folder: RunFolder, on_event) -> dict:
    """The whole-step baselines among `modes` (each [us, left out, error, process]), timed before the
    search and kept in compile_baselines.json. They compile the reference step only, so they hold for
    later searches of the folder (a re-lock after a kernel change) while the reference step and torch
    are the same, and a run stopped early in its search (`--budget 0`, e.g. on a GPU host whose kernel
    libraries are still being copied over) leaves them made: a max-autotune compile of the decode step
    takes minutes."""
    whole_key = {"profile": key, "torch": torch.__version__}
    whole = folder.saved(folder.COMPILE_BASELINES, whole_key, lambda saved: saved["modes"]) or {}
    for mode in modes:
        if not after_search(mode) and mode not in whole:
            on_event(StageStarted(f"torch.compile ({mode}) of the whole reference step"))
            whole[mode] = [*time_compile_baseline(stage, mode, {}), timing.PROCESS_ID]
            folder.write(folder.COMPILE_BASELINES, {"key": whole_key, "modes": whole})
            from torch import _dynamo

            _dynamo.reset()  # the search's per-point compiles start from a clean compiler state
    return whole


def time_compile_baseline(stage, baseline: str, results: dict) -> tuple[float | None, dict[str, str], str | None]:
    """The torch.compile build's step time (us), the points it keeps at their reference (why), and the
    error that left the baseline out. "points": a point whose compile fails here (a shape the search
    did not compile, a compiler bug) joins the points kept at their reference, and the build is timed
    again from a clean compiler state. The baseline is a row of the report: when it cannot be timed,
    the report says why (the traceback goes to stderr) and the lock is written all the same."""
    left_out = uncompilable(results) if baseline == POINTS_MODE else {}
    while True:
        try:
            if baseline.startswith(PLAIN):
                chosen = plain_choices(results)
                return stage.time_build({p: c.variant for p, c in chosen.items()},
                                        {p: c.config for p, c in chosen.items() if c.config},
                                        compile_mode=baseline[len(PLAIN):])["median_us"], {}, None
            if baseline != POINTS_MODE:
                return stage.time_build({}, compile_mode=baseline)["median_us"], {}, None
            return stage.time_build({p: "torch_compile" for p in POINTS if p not in left_out})["median_us"], \
                left_out, None
        except Exception as e:
            point = _compiled_point(e) if baseline == POINTS_MODE else None
            if point is None or point in left_out:
                traceback.print_exc()
                what = "of the whole step" if baseline != POINTS_MODE else "of every point"
                return None, left_out, f"torch.compile ({baseline}) {what} failed: {describe_error(e)}"
            left_out[point] = f"torch.compile failed in the end-to-end build ({describe_error(e)})"
            import torch._dynamo

            torch._dynamo.reset()  # a failed compile may leave guards and caches half-built


def _compiled_point(error: BaseException) -> str | None:
    """The point whose torch.compile'd reference raised `error`, read off its traceback: the registry's
    compile wrapper (one code object for every point) holds the reference function it compiles."""
    wrapper = compiled(len).__code__
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is wrapper:
            fn = tb.tb_frame.f_locals.get("fn")
            return next((p for p in POINTS if get(p, REFERENCE).fn is fn), None)
        tb = tb.tb_next
    return None


def uncompilable(results: dict) -> dict[str, str]:
    """Points whose torch_compile candidate the search saw fail, crash or stall, with why: the
    torch.compile build keeps their reference rather than compile them again (a compile that ran past
    the watchdog in the search would stall the end-to-end timing the same way)."""
    out = {}
    for point, r in results.items():
        c = next((c for c in r.candidates if c.variant == "torch_compile"), None)
        if c is not None and c.step_us is None:
            out[point] = c.skipped or (f"failed its gate: {c.failed_check}" if c.failed_check else "no time")
    return out
