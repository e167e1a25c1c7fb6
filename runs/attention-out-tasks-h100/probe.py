"""Where attention_out:triton_tasks's time goes at batch-1 decode (beam-501b-tp8 rank, 4K context): the
task kernel with stages taken out or its waits changed, against the three-launch sequences, each timed
as `workbench bench` times a point (CUDA graphs of back-to-back calls on rotated input copies), all in
one process, in alternating rounds.

The cut-down kernels (also on a grid of one program for each task they run, against the config's
programs a SM) are copies of `kernels/attention_tasks.py` (and `kernels/task_queue.py`) with one
edit each, written next to OUT, as tests/variants/test_attention_out_tasks.py plants its faults: their
outputs are not the point's (a stage is missing), only their time is read.

    PYTHONPATH=. python3 runs/attention-out-tasks-h100/probe.py OUT [--layer sliding|full] [--rounds 3]
"""

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

from workbench import registry
from workbench.points import Workload, spec
from workbench.timing import time_call
from workbench.variants.kernels import attention as attn
from workbench.variants.kernels import task_queue

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "workbench/variants/kernels"
ATTENTION_TASKS = "from workbench.variants.kernels import task_queue as queue"

NO_O_PROJ = ("n_o_proj = n_tokens * tl.cdiv(hidden, ROWS)", "n_o_proj = 0")
NO_MERGE = ("n_queued = n_attention + n_tokens * merged", "n_queued = n_attention")
NO_QUEUE = ("n_queued = n_attention + n_tokens * merged", "n_queued = 0")
NO_O_PROJ_WAIT = ("        queue.wait_for(gated_done + token, merged)\n", "")

# label -> edits of the task kernel's source (old, new), and of the queue's (None: the real queue)
CUTS = {
    "tasks": ([], None),
    "tasks: attention + merge-gate only": ([NO_O_PROJ], None),
    "tasks: attention only": ([NO_O_PROJ, NO_MERGE], None),
    "tasks: o_proj only, activations ready": ([NO_QUEUE, NO_O_PROJ_WAIT], None),
    "tasks: waits back off 64 ns a poll": ([], [(
        "            seen = tl.atomic_add(counter_ptr, 0, sem=\"acquire\", scope=\"gpu\")\n",
        "            tl.inline_asm_elementwise(\"nanosleep.u32 64;\\n mov.u32 $0, 0;\", \"=r\", [], dtype=tl.int32,\n"
        "                                      is_pure=False, pack=1)\n"
        "            seen = tl.atomic_add(counter_ptr, 0, sem=\"acquire\", scope=\"gpu\")\n")]),
}


def _module(name: str, source: str, folder: Path):
    path = folder / f"{name}.py"
    path.write_text(source)
    spec_ = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec_)
    sys.modules[name] = module
    spec_.loader.exec_module(module)
    return module


def _edited(text: str, edits) -> str:
    for old, new in edits:
        assert text.count(old) == 1, f"the kernel changed: {old!r}"
        text = text.replace(old, new)
    return text


def cut_kernel(i: int, label: str, folder: Path):
    kernel_edits, queue_edits = CUTS[label]
    source = _edited((KERNELS / "attention_tasks.py").read_text(), kernel_edits)
    if queue_edits is not None:
        _module(f"probe_queue_{i}", _edited((KERNELS / "task_queue.py").read_text(), queue_edits), folder)
        source = _edited(source, [(ATTENTION_TASKS, f"import probe_queue_{i} as queue")])
    source = source.replace('"attention_out_tasks"', f'"probe_tasks_{i}"')
    return _module(f"probe_tasks_{i}", source, folder)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layer", default="sliding")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    wl = Workload(preset="beam-501b-tp8", batch=1, context=4096, layer=args.layer)
    tasks = registry.get("attention_out", "triton_tasks")
    config = dict(tasks.configs[0], pdl=True)
    builds = {}
    for name in ("triton", "triton_widemerge"):
        v = registry.get("attention_out", name)
        builds[f"attention_out:{name}"] = ("attention_out", v.at(dict(v.configs[0], pdl=True)))
    # the tasks each cut runs, for the same cuts on a grid of one program a task
    q, cache, meta, *_ = spec("attention_out").make_inputs(wl, "cuda", 0).args
    splits = attn.decode_splits(1, cache.shape[3], meta.page_table.shape[1], cache.shape[2],
                                wl.config.sliding_window if args.layer == "sliding" else None, config["attention"],
                                q.device)
    merges = q.shape[1] * -(-q.shape[2] // attn.MERGE_BLOCK_D)
    one_each = {"tasks: attention + merge-gate only": splits + merges, "tasks: attention only": splits,
                "tasks: o_proj only, activations ready": -(-wl.config.hidden_size // config["tasks"]["ROWS"])}
    for i, label in enumerate(CUTS):
        module = cut_kernel(i, label, args.out)
        for grid in (None, one_each.get(label)):
            def fn(q, cache, meta, g, w, *, window, scale, _m=module, _grid=grid):
                programs = task_queue.programs
                if _grid:  # the grid is sized on the host when the call is captured
                    task_queue.programs = lambda device, per_sm, tasks: _grid
                try:
                    return _m.decode_tasks(q, cache, meta, g, w["gate_bias"], w["o_proj"], window=window,
                                           scale=scale, attention_cfg=dict(config["attention"], pdl=True),
                                           tasks_cfg=config["tasks"], pdl=True)
                finally:
                    task_queue.programs = programs
            if grid is None:
                builds[label] = ("attention_out", fn)
            elif label in one_each:
                builds[f"{label}, one program a task ({grid})"] = ("attention_out", fn)
    attention = registry.get("attention", "triton")
    builds["attention:triton (the decode kernel and its merge)"] = (
        "attention", attention.at(dict(config["attention"], pdl=True)))
    times = {label: [] for label in builds}
    for r in range(args.rounds):
        order = list(builds) if r % 2 == 0 else list(reversed(builds))
        for label in order:
            point, fn = builds[label]
            t = time_call(fn, lambda i, p=point: spec(p).make_inputs(wl, "cuda", i), device="cuda")
            times[label].append(t.median_us)
            print(f"round {r}: {label}: {t.median_us:.2f} us (spread {t.spread:.1%})", flush=True)
    summary = {label: round(statistics.median(ts), 2) for label, ts in times.items()}
    for label, us in summary.items():
        print(f"{label}: {us} us")
    (args.out / "probe.json").write_text(json.dumps({
        "command": "PYTHONPATH=. python3 runs/attention-out-tasks-h100/probe.py " + " ".join(sys.argv[1:]),
        "workload": wl.label(), "tasks_config": config, "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "median_us": summary, "rounds_us": times}, indent=1) + "\n")


if __name__ == "__main__":
    main()
