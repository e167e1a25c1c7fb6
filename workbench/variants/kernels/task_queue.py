"""A task queue for persistent Triton kernels: a launch of a few programs per SM runs a list of tasks in
one kernel, handing data from task to task through per-tile counters instead of kernel boundaries.

The tasks are numbered in an order where every task comes after the tasks it reads from (a topological
order), and a program takes the next number from one atomic ticket counter whenever it is free:
- `take`: the next ticket (call it only after the kernel's PDL wait: the counters belong to the
  previous launch of the same kernel until then);
- `wait_for`: spin until a counter reaches a count (acquire), after issuing the loads a task can make
  without its inputs (weights), so they stream while the producers run;
- `signal`: count a finished task in (CTA barrier, then release): its stores are visible to whoever
  acquires the count;
- `finish`: every program counts itself out once the queue is empty; the last one resets the ticket,
  the counters the launch used and the exit count, so each launch leaves them zeroed for the next
  (CUDA-graph replays included, no memset in the step).

Why it cannot deadlock: a program waits only on tasks with lower tickets, and a ticket is only ever
held by a program that is running (it took it), so the holder of the lowest unfinished ticket waits on
nothing and finishes. Tasks fixed per program (a program's share of the last stage, its weights loaded
before anything else) may follow once `take` has found the queue empty: every queued task is then held
by a running program. No grid barrier and no cooperative launch are needed, and the grid may be
smaller or larger than the task list. Under the Triton interpreter programs run one after another: the
first takes every ticket in order, so each wait is already met when it is reached, and the rest find
the queue empty.

Counters are int32 from `arrival_counters` (zeroed once, left zeroed by every launch): slot 0 is the
ticket, slot 1 the exit count, the rest the tasks' counters.
"""

import torch

from workbench.variants.kernels.arrivals import arrival_counters
from workbench.variants.kernels.triton_common import triton

TICKET, EXIT, FIRST_COUNTER = 0, 1, 2  # the queue's slots: the tasks' counters start at FIRST_COUNTER

if triton is not None:
    import triton.language as tl

    _TICKET, _EXIT, _FIRST_COUNTER = tl.constexpr(TICKET), tl.constexpr(EXIT), tl.constexpr(FIRST_COUNTER)

    @triton.jit
    def counters(queue_ptr):
        """The tasks' counters of the queue."""
        return queue_ptr + _FIRST_COUNTER

    @triton.jit
    def take(queue_ptr):
        """The next ticket of the launch (a scalar)."""
        return tl.atomic_add(queue_ptr + _TICKET, 1, sem="relaxed", scope="gpu")

    @triton.jit
    def wait_for(counter_ptr, count):
        """Spin until the counter reaches `count`; the producers' stores are then visible (read them
        with cache_modifier=".cg": another SM wrote them during this launch)."""
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        while seen < count:
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")

    @triton.jit
    def signal(counter_ptr):
        """Count a finished task in: every thread's stores are issued before the release."""
        tl.debug_barrier()
        tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")

    @triton.jit
    def finish(queue_ptr, n_counters, BLOCK: tl.constexpr):
        """Count this program out; the last one zeroes the ticket, the first `n_counters` task counters
        and the exit count (every other program has left the queue: nobody reads them any more)."""
        tl.debug_barrier()
        if tl.atomic_add(queue_ptr + _EXIT, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            offs = tl.arange(0, BLOCK)
            for start in range(0, n_counters, BLOCK):
                tl.store(queue_ptr + _FIRST_COUNTER + start + offs, tl.zeros([BLOCK], tl.int32),
                         mask=start + offs < n_counters)
            tl.atomic_xchg(queue_ptr + _TICKET, 0)
            tl.atomic_xchg(queue_ptr + _EXIT, 0)


def queue_counters(n_counters: int, device: torch.device, owner: str) -> torch.Tensor:
    """The zeroed int32 queue of kernel family `owner`: ticket, exit count, then `n_counters` counters."""
    return arrival_counters(FIRST_COUNTER + n_counters, device, owner)


def programs(device: torch.device, per_sm: int, tasks: int) -> int:
    """The persistent grid: `per_sm` programs on each SM (4 "SMs" on a CPU, under the interpreter), never more
    than there are tasks."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(tasks, sms * per_sm))
