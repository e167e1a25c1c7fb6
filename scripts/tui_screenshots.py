"""SVG screenshots of the terminal UI on a real beam-tiny search (CPU), for docs/tui/.

Drives `workbench.tui.WorkbenchApp` headless with textual's Pilot, exactly as a person would:
g starts the search, the Search view is captured while candidates arrive and when it is done,
then the Profile view (a searched point selected), the Lock view after v (verify), the help
screen and the Profile view in the light theme. The run folder is a temporary one (shown as
runs/tui-demo) unless --out names one. It only presses keys and saves screenshots; every number
in them comes from the run.

    python scripts/tui_screenshots.py [--out RUN_DIR] [--docs docs/tui]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

import torch

from workbench.optimize import OptimizeOptions
from workbench.tui import WorkbenchApp

SIZE = (150, 42)
POINTS = ("boundary", "qkvg_proj", "route")


async def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


async def shoot(out: str, docs: str) -> None:
    opts = OptimizeOptions(target="decode-b1", preset="beam-tiny", dtype=torch.float32, device=torch.device("cpu"),
                           out_dir=out, points=POINTS, command="python scripts/tui_screenshots.py")
    app = WorkbenchApp(opts)

    def save(name: str) -> None:
        path = app.save_screenshot(filename=f"{name}.svg", path=docs)
        print(f"wrote {path} ({os.path.getsize(path) // 1024} KiB)")

    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g")
        await wait_for(lambda: len(app.search_view.candidates) >= 2, 300, "candidates")
        await pilot.pause()
        save("search-live")
        await wait_for(lambda: not app.searching, 600, "the search to finish")
        await pilot.pause()
        save("search-done")
        await pilot.press("1")
        names = [str(app.query_one("#profile-points").get_row_at(i)[0])
                 for i in range(app.query_one("#profile-points").row_count)]
        await pilot.press(*["down"] * names.index("boundary"))
        await pilot.pause()
        save("profile")
        await pilot.press("3", "v")
        await wait_for(lambda: not app.lock_view.verdict.startswith("verifying"), 300, "verify")
        await pilot.pause()
        save("lock")
        await pilot.press("question_mark")
        await pilot.pause()
        save("help")
        await pilot.press("escape", "1", "t")  # the same profile in the light theme
        await pilot.pause()
        save("profile-light")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="run folder (default: a temporary one)")
    ap.add_argument("--docs", default="docs/tui", help="where the SVGs go (default: %(default)s)")
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # interpreted Triton is for correctness tests, not timing
    docs = os.path.abspath(args.docs)
    os.makedirs(docs, exist_ok=True)
    if args.out:
        asyncio.run(shoot(args.out, docs))
        return
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)  # the screenshots show a readable run folder, not a temporary path
        asyncio.run(shoot("runs/tui-demo", docs))


if __name__ == "__main__":
    main()
