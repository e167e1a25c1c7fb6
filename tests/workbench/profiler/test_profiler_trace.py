"""Kernels attributed to ranges from a Chrome trace by launch time: driver-API launches (Triton's
`cuLaunchKernelEx`, which carries no External id) count like runtime launches."""

import pytest

from beam_model.config import BeamConfig
from workbench.profiler.attribution import summarize
from workbench.profiler.trace import device_work


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


def _stalled_trace():
    """A route kernel, then the host waits in a stream sync inside experts' `.item()` while the device
    drains (gap 1), then two overlapping kernels, then a launch outside every point (gap 2)."""
    return [
        _event("user_annotation", "fp:route", 0, 50),
        _event("cuda_runtime", "cudaLaunchKernel", 5, 2, correlation=1),
        _event("cuda_driver", "cuLaunchKernelEx", 6, 2, correlation=4),
        _event("user_annotation", "fp:experts", 50, 150),
        _event("cpu_op", "aten::item", 60, 90),
        _event("cuda_runtime", "cudaStreamSynchronize", 61, 88),
        _event("cuda_runtime", "cudaLaunchKernel", 152, 2, correlation=2),
        _event("cuda_runtime", "cudaLaunchKernel", 160, 2, correlation=3),
        _event("cuda_runtime", "cudaLaunchKernel", 290, 2, correlation=5),
        _event("kernel", "route_gemv", 10, 90, tid=7, correlation=1),
        _event("kernel", "route_side", 20, 20, tid=8, correlation=4),      # another stream, inside route_gemv
        _event("kernel", "gate_up", 155, 10, tid=7, correlation=2),
        _event("kernel", "down", 162, 18, tid=8, correlation=3),           # overlaps gate_up
        _event("kernel", "sample", 300, 10, tid=7, correlation=5),
    ]


def test_device_idle_names_each_gap_and_what_the_host_was_doing():
    from workbench.profiler.idle import device_idle, idle_line

    idle = device_idle(_stalled_trace())
    assert (idle["span_us"], idle["busy_us"], idle["idle_us"], idle["gaps"]) == (300, 125, 175, 2)
    assert idle["idle_by_point"] == {"(no point)": 120, "experts": 55}
    outside, sync = idle["widest"]
    assert outside == {"at_us": 170, "us": 120, "before": "down", "after": "sample", "launched_in": "(no point)",
                       "host_op": None, "host_call": None, "host_point": "experts"}
    assert sync == {"at_us": 90, "us": 55, "before": "route_gemv", "after": "gate_up", "launched_in": "experts",
                    "host_op": "aten::item", "host_call": "cudaStreamSynchronize", "host_point": "experts"}
    assert device_idle(_stalled_trace(), top=1)["widest"] == [outside]
    assert idle_line(idle) == ("device idle 0.175 ms of its 0.300 ms span (58.3%, 2 gaps); "
                               "ms of it ahead of launches in: (no point) 0.120, experts 0.055")


def test_device_idle_without_device_work_is_none():
    from workbench.profiler.idle import device_idle, idle_line

    cpu_only = [e for e in _stalled_trace() if e["cat"] != "kernel"]
    assert device_idle(cpu_only) is None and idle_line(None) is None
    assert summarize(_trace(), BeamConfig.from_preset("beam-tiny"))["idle"]["idle_us"] == 0.0  # back to back


def test_optimize_report_says_where_the_locked_step_idled():
    import json
    from pathlib import Path

    from workbench.profiler.idle import device_idle
    from workbench.report import report_markdown

    with open(Path(__file__).parents[3] / "runs/optimize-prefill-8x2k-beam-501b-tp8/report.json") as f:
        report = json.load(f)
    assert "device idle" not in report_markdown({**report, "locked_idle": None})
    md = report_markdown({**report, "locked_idle": device_idle(_stalled_trace())})
    assert "In the locked step's profile (eager, under the profiler): device idle 0.175 ms" in md


def test_short_names_drop_return_types_parameters_and_long_template_lists():
    """Names as the H200's profiler records them (runs/bench-attention-tp8/splits/): a templated ATen
    kernel's name runs to hundreds of characters, which would wrap a bench table over many lines."""
    from workbench.bench_report import top_kernels
    from workbench.profiler.trace import short_name

    aten = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
            "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#12}::"
            "operator()() const::{lambda(c10::BFloat16)#1}>(at::TensorIteratorBase&, ...)::{lambda(int)#1}>(int, "
            "at::native::gpu_kernel_impl_nocast<...>)")
    assert short_name(aten) == "at::native::elementwise_kernel<...>"
    assert short_name("void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long, long, "
                      "long, long, bool)") == "at::native::vectorized_gather_kernel<16, long>"
    assert short_name("void cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_nn_align1>(cutlass_80_simt_sgemm_"
                      "64x64_8x5_nn_align1::Params)") == "cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_nn_align1>"
    assert short_name("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
                      "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)") == \
        "at::native::(anonymous namespace)::cunn_SoftMaxForward<...>"
    for whole in ("_decode_kernel", "Memcpy DtoD (Device -> Device)", "void cut<short(int",
                  "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize32x32x8_stage3_warpsize1x2x1_ffma_cublas"):
        assert short_name(whole) == whole  # not demangled C++, or cut short: kept whole
    assert top_kernels([{"kernel": aten, "launches": 2.0, "us": 19.28}]) == \
        [("at::native::elementwise_kernel<...>", "2", "19.28")]


def test_profiling_drops_kinetos_start_stop_markers_and_passes_other_stderr_on(capfd):
    import os

    import torch
    from torch.profiler import ProfilerActivity

    from workbench.profiler.quiet import _without_markers, profiling

    with profiling([ProfilerActivity.CPU]) as prof:  # torch 2.13 marks both on fd 2
        torch.ones(4).sum()
    assert any(e.name == "aten::sum" for e in prof.events())
    with _without_markers():
        os.write(2, b"USDT:2026-12-04 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\nwarning: kept\n")
    with pytest.raises(RuntimeError, match="in the body"), profiling([ProfilerActivity.CPU]):
        raise RuntimeError("in the body")
    err = capfd.readouterr().err
    assert "USDT:" not in err and "warning: kept" in err


def test_profile_table_keeps_point_and_variant_names_whole_at_80_columns():
    """The decode lock's profile (runs/optimize-decode-b1-beam-501b-tp8/locked_profile.json): rich's
    default table cut `attention_out` to `attentio…` and `triton_prefetch` to `triton…` at 80 columns."""
    import io
    import json
    from pathlib import Path

    from rich.console import Console

    from workbench.profiler.attribution import Profile
    from workbench.progress import profile_table

    with open(Path(__file__).parents[3] / "runs/optimize-decode-b1-beam-501b-tp8/locked_profile.json") as f:
        profile = Profile.from_dict(json.load(f))
    out = io.StringIO()
    Console(file=out, width=80).print(profile_table(profile))
    rows = {line.split()[0]: line.split() for line in out.getvalue().splitlines() if line.split()}
    assert max(len(line) for line in out.getvalue().splitlines()) <= 80
    for p in profile.points:
        assert rows[p.point][1] == p.variant, rows.get(p.point)
        assert rows[p.point][3] == f"{p.time_us:.1f}"
    assert "…" not in out.getvalue()
