"""The target's step with agent-written variants in it, run natively by a process of its own.

A process that judges, times or locks never imports a candidate (`candidates.load_sandboxed`): there each
one runs in its op sandbox, a round trip per call, which is right for the gates and wrong for timing a
whole step (and no CUDA graph can capture it). So the end-to-end stage of `workbench optimize` times
its builds here once the agent has a candidate accepted: this process imports the candidates' files
(after the static check) and the plugin files the caller itself imported (`--dir`: already run
there), builds the same model (preset, seed, dtype, device) and the target's step,
and runs what it is asked.

The caller keeps what decides: the clock (round trips of `n` steps, less an empty round trip, fresh
input tokens for every round so no step is answered from memory), and the gates (run in the caller
on its sandboxed variants). Before a build's timing counts, the tokens it draws here for fresh inputs
must equal those the caller's gated build draws: a build that computes something else here than what
was gated is refused. What importing a candidate could change in this process is bounded by the
static check (no module's state is assigned), so the builds without candidates run here too, timed
the same way as those with them.

At full size this process holds a second copy of the weights.
"""

from __future__ import annotations

import math
import time
import traceback
import uuid
from typing import Callable

import torch

from workbench import timing
from workbench.agent.sandbox import Child, SandboxError, serve_requests

ROUND_S = 0.02   # a timed round runs at least this long, so its round trip is a small part of it
EMPTY_TRIPS = 5  # round trips without a step; their minimum is subtracted from every round


class StepSandboxError(SandboxError):
    """The step sandbox failed, or a build computes something else there than what was gated."""


class StepSandbox(Child):
    """`files`' variants imported (static check first; `imported`: files the caller imported, as they
    are), on the model `preset` builds (`seed`, `dtype` name, `device`), with the step of target
    `target`. `expected(selection, configs, input_ids)`: the tokens the caller's gated build draws for
    those inputs (`gated_tokens`)."""

    def __init__(self, files: list[str], *, preset: str, seed: int, dtype: str, device: str, target: str,
                 expected: Callable[[dict, dict, torch.Tensor], torch.Tensor], imported: list[str] = (),
                 threads: int | None = None):
        self.expected = expected
        self.process_id = "step-sandbox-" + uuid.uuid4().hex[:8]
        self._empty_s: float | None = None
        super().__init__(_serve, (list(files), list(imported), preset, seed, dtype, device, target,
                                  threads or torch.get_num_threads()), "step sandbox")
        self.tokens, self.vocab = self.info["tokens"], self.info["vocab"]

    def _fresh_ids(self) -> torch.Tensor:
        return torch.randint(0, self.vocab, (self.tokens,))

    def time_build(self, selection: dict, configs: dict | None = None, *, compile_mode: str | None = None,
                   budget_s: float = 2.0, max_seconds: float | None = None, **_) -> dict:
        """The step of `selection` timed by this side's clock: rounds of `n` steps (each round at least
        ROUND_S), per-step samples until `timing.reps_for`'s count or the budget; the keys of
        `timing.time_fn`'s result that the end-to-end stage reads."""
        configs = configs or {}
        self._ask("bind", selection, configs, compile_mode)
        if compile_mode is None:  # a compiled build's numerics are the compiler's, not the gated ones
            self.check(selection, configs)
        if self._empty_s is None:
            ids = self._fresh_ids()
            self._empty_s = min(self._round_trip("run", 0, ids) for _ in range(EMPTY_TRIPS))
        self._round(1)  # compiles and lazy inits outside the samples
        step_s = max(self._round(1), 1e-7)
        n = max(1, math.ceil(ROUND_S / step_s))
        self._round(n)
        want = timing.reps_for(step_s * n, budget_s)["min_reps"]
        until = time.perf_counter() + (max_seconds if max_seconds is not None else budget_s)
        samples = []
        while len(samples) < 5 or (len(samples) < want and time.perf_counter() < until):
            samples.append(self._round(n) / n * 1e6)
        med, p10, p90, spread = timing.summarize(samples)
        return {"median_us": med, "p10_us": p10, "p90_us": p90, "spread": spread, "reps": len(samples),
                "steps_per_round": n, "graph": self.info["graph"], "process": self.process_id}

    def _round(self, n: int) -> float:
        """Seconds of `n` steps on fresh input tokens, less the empty round trip."""
        return max(self._round_trip("run", n, self._fresh_ids()) - (self._empty_s or 0.0), 0.0)

    def check(self, selection: dict, configs: dict) -> None:
        """The bound build draws here, for fresh inputs, the tokens the caller's gated build draws."""
        ids = self._fresh_ids()
        here = self._ask("tokens", ids)
        gated = self.expected(selection, configs, ids).cpu()
        if not torch.equal(here, gated):
            differ = int((here != gated).sum())
            raise StepSandboxError(f"the build {selection or 'reference'} draws other tokens in the step sandbox "
                                   f"than the gated build does ({differ} of {gated.numel()} differ): what it "
                                   "runs unsandboxed is not what the gates passed")

    def profile(self, selection: dict, configs: dict, *, ceilings: dict, trace_path: str | None):
        """`profile_step` of the build, run here (`Profile`)."""
        from workbench.profiler.attribution import Profile

        return Profile.from_dict(self._ask("profile", selection, configs, ceilings, trace_path))

    def in_step(self, selection: dict, configs: dict, *, budget_s: float, log=print) -> dict:
        """`in_step_costs` of the build, run here; its lines go to `log` once it returns."""
        result, lines = self._ask("in_step", selection, configs, budget_s)
        for line in lines:
            log(line)
        return result


def gated_tokens(runner) -> Callable[[dict, dict, torch.Tensor], torch.Tensor]:
    """`StepSandbox.expected` for the caller's `runner` (`targets.StepRunner`): one eager step of the build
    on the caller's model (its sandboxed variants run in their sandboxes) with the given inputs."""

    @torch.inference_mode()
    def tokens(selection: dict, configs: dict, input_ids: torch.Tensor) -> torch.Tensor:
        runner.model.set_variants(selection, configs)
        runner.input_ids.copy_(input_ids.to(runner.input_ids.device))
        logits = runner.model.step(runner.input_ids, runner.cache, runner.step)
        return runner.model.ops.sample(logits, **runner.sampling)

    return tokens


# ------------------------------------------------------------------------------------ the sandbox's side

def _serve(conn, files, imported, preset, seed, dtype, device, target_name, threads) -> None:
    from beam_model import BeamForCausalLM
    from workbench.agent.plugins import load_file
    from workbench.dtypes import dtype_of
    from workbench.targets import StepRunner, for_device, get_target

    torch.set_num_threads(threads)
    try:
        for path in imported:
            load_file(path, static=False)
        for path in files:
            load_file(path)
        model = BeamForCausalLM.from_preset(preset, seed=seed, dtype=dtype_of(dtype), device=device)
        target = for_device(get_target(target_name), torch.device(device))
        runner = StepRunner(model, target)
    except BaseException:  # noqa: BLE001 - reported to the caller, whatever the candidate raised
        conn.send(("raised", "the step sandbox did not start:\n" + traceback.format_exc(limit=-8)))
        return
    cuda = torch.device(device).type == "cuda"
    conn.send(("ready", {"tokens": runner.input_ids.numel(), "vocab": model.config.vocab_size,
                         "graph": runner.use_graph}))
    serve_requests(conn, lambda kind, args: _answer(kind, args, runner, target, preset, dtype, device, cuda))


def _answer(kind, args, runner, target, preset, dtype, device, cuda):
    if kind == "bind":
        selection, configs, compile_mode = args
        runner.rebind(selection, configs, compile_mode=compile_mode)
        return None
    if kind == "run":
        n, ids = args
        runner.input_ids.copy_(ids.to(runner.input_ids.device))
        for _ in range(n):
            runner()
        if cuda:
            torch.cuda.synchronize()
        return None
    if kind == "tokens":
        runner.input_ids.copy_(args[0].to(runner.input_ids.device))
        return runner().clone().cpu()
    if kind == "profile":
        from workbench.profiler import profile_step

        selection, configs, ceilings, trace_path = args
        runner.rebind(selection, configs)
        return profile_step(runner, workload_for=lambda k: target.workload(preset, dtype, k), ceilings=ceilings,
                            trace_path=trace_path).to_dict()
    if kind == "in_step":
        from workbench.profiler.in_step import in_step_costs

        selection, configs, budget_s = args
        lines = []
        result = in_step_costs(runner, selection, configs, device=device, budget_s=budget_s, log=lines.append)
        return result, lines
    raise ValueError(f"unknown request {kind!r}")


def for_accepted(runner, *, preset: str, seed: int, dtype: str, target: str) -> StepSandbox | None:
    """A step sandbox with every candidate registered through a sandbox in this process, or None when
    there is none; `runner` is this process's step (the gated builds' tokens)."""
    from workbench.agent.candidates import sandboxed_files
    from workbench.agent.plugins import imported_files

    files = sandboxed_files()
    if not files:
        return None
    return StepSandbox(files, preset=preset, seed=seed, dtype=dtype, device=str(runner.model.device),
                       target=target, expected=gated_tokens(runner), imported=imported_files())
