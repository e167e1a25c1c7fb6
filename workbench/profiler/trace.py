"""Device kernels of a torch.profiler Chrome trace, attributed to the workbench's ranges by launch time.

torch.profiler links a kernel to the CPU op that launched it through the launch's "External id".
Kernels that Triton (and Inductor's Triton code) launch through the driver API (`cuLaunchKernelEx`)
carry no External id, so the op tree shows them under no range and a Triton build's kernels go
uncounted. Here every launch event (runtime or driver API) is joined to its kernel by
correlation id and placed in the fusion-point and layer ranges whose CPU interval holds it.

`attribution.summarize` (`workbench profile --from-trace TRACE[.gz] --preset P`) re-attributes a saved trace.
Never runs a model; reads the trace only.
"""

from __future__ import annotations

import bisect
import gzip
import json

from workbench.profiler.ranges import LAYER_RANGE, POINT_RANGE

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def device_work(events: list[dict]) -> tuple[list[tuple[str, list[tuple[str, float]]]], list[tuple[str, float]]]:
    """([(range name, [(kernel, us), ...]) for each point / layer range occurrence], all kernels)."""
    device = {e["args"]["correlation"]: (e["name"], float(e.get("dur", 0.0)))
              for e in events if e.get("cat") in DEVICE_CATS and "correlation" in e.get("args", {})}
    launches = sorted((e["ts"], e.get("tid"), device[e["args"]["correlation"]]) for e in events
                      if e.get("cat") in LAUNCH_CATS and e.get("args", {}).get("correlation") in device)
    starts = [ts for ts, _, _ in launches]
    ranges = []
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"].startswith((POINT_RANGE, LAYER_RANGE)):
            lo = bisect.bisect_left(starts, e["ts"])
            hi = bisect.bisect_right(starts, e["ts"] + e.get("dur", 0.0))
            ranges.append((e["name"], [w for _, tid, w in launches[lo:hi] if tid == e.get("tid")]))
    return ranges, list(device.values())


def layer_kind(config, index: int) -> str:
    return ("full" if config.layer_types[index] == "full_attention" else "sliding") + \
           ("+moe" if config.is_moe_layer(index) else "+dense")


ANONYMOUS = "(anonymous namespace)"


def short_name(kernel: str, template_chars: int = 64) -> str:
    """A CUDA C++ kernel's name for a table, as Nsight Systems shortens it but keeping short template
    lists: `void at::native::elementwise_kernel<128, 4, ...lambdas...>(int, ...)` reads
    `at::native::elementwise_kernel<...>`, while `cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_nn_align1>`
    keeps its informative argument. The return type and the parameter list go. Names that are not
    demangled C++ (Triton's, cuBLAS's, memcpys) are kept whole, and results files keep every full name."""
    if not kernel.startswith("void "):
        return kernel
    name = kernel[5:].replace(ANONYMOUS, "\0")  # its parentheses are no parameter list
    out, stack, start = [], [], 0
    for i, ch in enumerate(name):
        if ch in "<(":
            if not stack:
                out.append(name[start:i])
                start = i
            stack.append(ch)
        elif stack and (ch, stack[-1]) in ((">", "<"), (")", "(")):
            stack.pop()
            if not stack:
                group = name[start:i + 1]
                if group[0] == "<":  # a parameter list "(...)" is dropped
                    shown = len(group.replace("\0", ANONYMOUS)) <= template_chars
                    out.append(group if shown else "<...>")
                start = i + 1
    if stack:  # unbalanced (a name cut short): keep it as it was
        return kernel
    return ("".join(out) + name[start:]).replace("\0", ANONYMOUS).strip()
