"""The console's progress lines and summary (workbench/progress.py), from the run's events and report."""

from rich.console import Console

from workbench.events import Challenged, DroppedAsNoise, PairedTimed
from workbench.progress import ConsoleProgress


def test_console_summary_names_builds_timed_in_another_process():
    report = {"target": "t", "preset": "p", "dtype": "bf16", "gpu": None, "reference_ms": 2.0, "locked_ms": 1.0,
              "speedup": 2.0, "torch_compile_ms": 1.5, "speedup_vs_torch_compile": 1.5, "points": []}
    for apart, shown in ((["reference"], True), ([], False), (None, False)):
        console = Console(record=True, width=200)
        ConsoleProgress(console).summary({**report, "timed_apart": apart}, "out")
        text = console.export_text()
        assert ("timed in a process other than the locked build's (ratios to it pair two processes): reference"
                in text) == shown, apart
    console = Console(record=True, width=200)
    progress = ConsoleProgress(console)
    progress.event(DroppedAsNoise(choices={"head": "triton"}, band=0.01, before_us=990.0, after_us=1000.0))
    progress.event(PairedTimed(choices={"head": "triton"}, gain=0.001, band=0.005, rounds=[[990.0, 991.0]] * 10,
                               kept=False))
    progress.summary({**report, "dropped": {"head": "triton"}, "step_band": 0.01, "before_drop_ms": 0.99}, "out")
    text = console.export_text()
    assert "dropped as noise (each reverted within 1.0%): head:triton; step 990.0 us with them, 1000.0 us without" \
        in text
    assert "each reverted within the noise: head:triton; without them the step is 0.10% slower in 10 paired " \
        "rounds (band 0.50%): to be dropped" in text
    progress.event(Challenged(point="experts", variant="triton_rows", config={"pdl": True}, op_us=1376.7,
                              choice_op_us=1397.9, gain=0.05, band=0.005, rounds=[[1.0, 1.05]] * 10, won=True))
    assert "experts: triton_rows {'pdl': True} tied at the op level, tried end to end: with the choice the step " \
        "is 5.00% slower in 10 paired rounds (band 0.50%): taken" in console.export_text()
    assert "Dropped at the end-to-end stage, each reverted within the step's noise band (1.0%): head:triton; the " \
        "chosen set with them timed 0.990 ms, the locked set without them 1.000 ms." in text
