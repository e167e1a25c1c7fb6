"""Kernels attributed to ranges from a Chrome trace by launch time: driver-API launches (Triton's
`cuLaunchKernelEx`, which carries no External id) count like runtime launches."""

from beam_model.config import BeamConfig
from workbench.profiler.trace import device_work, summarize


def _event(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def _trace():
    return [
        _event("user_annotation", "layer.0", 0, 100),
        _event("user_annotation", "fp:boundary", 10, 20),
        _event("cuda_driver", "cuLaunchKernelEx", 12, 2, correlation=1),       # Triton: no External id
        _event("user_annotation", "fp:attention", 40, 40),
        _event("cuda_runtime", "cudaLaunchKernel", 45, 2, correlation=2, **{"External id": 7}),
        _event("cuda_driver", "cuLaunchKernel", 60, 2, correlation=3),
        _event("cuda_driver", "cuLaunchKernelEx", 65, 2, tid=2, correlation=4),  # another thread's launch
        _event("cuda_runtime", "cudaLaunchKernel", 150, 2, correlation=5),      # outside every range
        *[_event("kernel", f"k{c}", 1000 + c, 3.0, tid=7, correlation=c) for c in range(1, 6)],
    ]


def test_launches_land_in_the_ranges_that_hold_them():
    ranges, all_work = device_work(_trace())
    got = {name: [k for k, _ in work] for name, work in ranges}
    assert got == {"layer.0": ["k1", "k2", "k3"], "fp:boundary": ["k1"], "fp:attention": ["k2", "k3"]}
    assert len(all_work) == 5


def test_summary_counts_kernels_per_layer_kind_and_point():
    s = summarize(_trace(), BeamConfig.from_preset("beam-tiny"))
    assert s["kernels_per_layer"] == {"sliding+dense": 3}
    assert s["points"]["attention"] == {"kernels": 2, "us": 6.0}
    assert s["kernels_per_step"] == 5


def test_profile_command_summarizes_a_saved_trace(tmp_path, capsys):
    import gzip
    import json

    from workbench.cli import main

    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    assert main(["profile", "--from-trace", str(path), "--preset", "beam-tiny"]) == 0
    assert json.loads(capsys.readouterr().out)["kernels_per_layer"] == {"sliding+dense": 3}
    assert main(["profile", "--from-trace", str(path)]) == 2  # which model: named, not guessed
