"""Where a target's time goes: per fusion point, per layer and per kernel.

`instrument(model)` wraps every fusion-point call and every layer in a torch.profiler range and an
NVTX range (visible in Nsight Systems); `profile_step(runner, ...)` runs a target step eagerly under
torch.profiler and attributes device time (CPU time on a CPU-only machine) and kernel launches to
points and layer kinds. That profile never changes which variants run and never times the
graph-replayed step itself (that is `workbench.bench`); it explains a step, it does not score it.
`in_step.in_step_costs` (`profile --in-step`) explains the step as it runs instead: the graphed step
timed with each point replaced by a kernel-free stand-in, which an eager profile cannot show.
`kernels_per_call(fn, device)` lists the kernels of one call of a single variant (`bench --kernels`).
"""

from workbench.profiler.attribution import PointProfile, Profile, kernels_per_call, profile_step
from workbench.profiler.ranges import instrument

__all__ = ["instrument", "profile_step", "kernels_per_call", "Profile", "PointProfile"]
