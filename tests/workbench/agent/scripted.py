"""A scripted stand-in for a coding agent: `python scripted.py BEHAVIOUR[,BEHAVIOUR...] TASK_DIR`.

Like a real agent it reads the task folder and leaves `variant.py` there; what it writes is fixed
by BEHAVIOUR (for the `boundary` point). With a comma-separated list, round k plays the k-th one.
Each behaviour is one way a candidate can be right, wrong or hostile; test_agent.py (beside this file)
names the verdict each must get.
"""

import os
import re
import sys
import time

HEADER = '''import torch
import torch.nn.functional as F
from beam_model.functional import rms_norm
from workbench.registry import register
'''

# The reference's math, as a body every behaviour below starts from.
REFERENCE_BODY = '''    a, b = w["residual"][0], w["residual"][1]
    h_new = (a * h.float() + b * rms_norm(y, w["post_norm"], eps)).to(h.dtype)
    if w["next_norm"] is None:
        return h_new, None
    return h_new, rms_norm(h_new, w["next_norm"], eps).to(h.dtype)
'''

BEHAVIOURS = {
    # Right, and faster: fewer ops (rms_norm fused by torch, the add as one addcmul).
    "faster": '''    a, b = w["residual"].unbind()
    hidden = (h.shape[-1],)
    h_new = torch.addcmul(a * h, F.rms_norm(y, hidden, w["post_norm"], eps), b)
    if w["next_norm"] is None:
        return h_new, None
    return h_new, F.rms_norm(h_new, hidden, w["next_norm"], eps)
''',
    # Wrong: forgets the depth scaling of the residual.
    "wrong": '''    h_new = (h.float() + rms_norm(y, w["post_norm"], eps)).to(h.dtype)
    if w["next_norm"] is None:
        return h_new, None
    return h_new, rms_norm(h_new, w["next_norm"], eps).to(h.dtype)
''',
    # Crashes the process on its first call with an illegal memory access (a sparse tensor, its index far
    # outside it, left unchecked, made dense), through nothing the static check refuses.
    "crash": '''    index = torch.tensor([[1 << 40]])
    torch.sparse_coo_tensor(index, torch.ones(1), (2,), check_invariants=False).to_dense()
''' + REFERENCE_BODY,
    # Never returns.
    "loops": '''    while True:
        pass
''',
    # Banned: delegates to the reference.
    "calls_reference": '''    from workbench.variants.boundary import boundary
    return boundary(y, h, w, eps=eps, group=group)
''',
    # Banned: reads the clock (e.g. to behave differently while timed).
    "uses_time": '''    import time
    time.perf_counter()
''' + REFERENCE_BODY,
    # Banned: a side stream.
    "cuda_stream": '''    if torch.cuda.is_available():
        torch.cuda.Stream()
''' + REFERENCE_BODY,
    # Banned: threads.
    "threading": '''    import threading
    threading.Thread(target=lambda: None).start()
''' + REFERENCE_BODY,
    # Banned: reads a file.
    "reads_file": '''    open(__file__).read()
''' + REFERENCE_BODY,
    # Judge-level: caches its result by input address (right the first time it sees a buffer).
    "stale": '''    key = (y.data_ptr(), h.data_ptr())
    if key not in _MEMO:
        _MEMO[key] = _full(y, h, w, eps)
    return tuple(None if t is None else t.clone() for t in _MEMO[key])
''',
    # Judge-level: right through the gate's few calls, garbage once timing has started.
    "late_garbage": '''    _CALLS.append(1)
    if len(_CALLS) > 40:
        return torch.zeros_like(h), (None if w["next_norm"] is None else torch.zeros_like(h))
''' + REFERENCE_BODY,
}

def slow(name: str) -> str:
    """A plugin module registering `boundary:NAME`: the reference's math ten times (an incumbent to beat)."""
    return HEADER + f"""

def _once(y, h, w, eps):
{REFERENCE_BODY}

@register("boundary", "{name}", "torch")
def {name}(y, h, w, *, eps, group=None):
    for _ in range(9):
        _once(y, h, w, eps)
    return _once(y, h, w, eps)
"""


HELPERS = '''
_MEMO = {}
_CALLS = []


def _full(y, h, w, eps):
''' + REFERENCE_BODY


def write(task_dir: str, behaviour: str) -> None:
    path = os.path.join(task_dir, "variant.py")
    with open(path) as f:
        scaffold = f.read()
    register = re.search(r'^@register\(.*\)$', scaffold, re.M).group(0)
    body = BEHAVIOURS[behaviour]
    with open(path, "w") as f:
        f.write(f'"""Stand-in agent output: {behaviour}."""\n\n{HEADER}{HELPERS}\n\n{register}\n'
                f'def candidate(y, h, w, *, eps, group=None):\n{body}')


def main(argv) -> int:
    plan, task_dir = argv[0].split(","), argv[1]
    k = int(re.search(r"round-(\d+)", task_dir).group(1)) if "round-" in task_dir else 1
    behaviour = plan[min(k, len(plan)) - 1]
    print(f"round {k}: {behaviour}")
    if behaviour == "hang":  # the agent itself never finishes
        while True:
            time.sleep(1)
    write(task_dir, behaviour)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
