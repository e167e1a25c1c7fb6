"""SVG screenshots of the terminal UI opened on a finished run folder, for docs/tui/.

Opens `workbench.tui.WorkbenchApp` on the run folder as `workbench tui --run DIR` does (default: the
committed decode-b1 run on the H200) and drives it headless with textual's Pilot, as a person would:
the Profile view (a searched point selected), the Search view (every point's candidates and
choice), the Lock view, the help screen, and the Profile view in the light theme. The header shows
the device the run recorded, whatever machine this runs on. It only presses keys and saves
screenshots: every number in them comes from the run folder's files. It never writes there.

    python scripts/tui_screenshots.py [--run RUN_DIR] [--point POINT] [--docs docs/tui]
"""

from __future__ import annotations

import argparse
import asyncio
import os

from workbench.commands.tui import add_arguments, options
from workbench.tui import WorkbenchApp

SIZE = (150, 42)
RUN = "runs/optimize-decode-b1-beam-501b-tp8"


async def shoot(run: str, point: str, docs: str) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    app = WorkbenchApp(options(parser.parse_args(["--run", run])), run_dir=run)

    def save(name: str) -> None:
        path = app.save_screenshot(filename=f"{name}.svg", path=docs)
        print(f"wrote {path} ({os.path.getsize(path) // 1024} KiB)")

    async def show(*keys: str) -> None:
        await pilot.press(*keys)
        await pilot.pause(0.5)  # the view's table takes the focus after a refresh, and the footer its keys

    async with app.run_test(size=SIZE) as pilot:
        await show()
        table = app.query_one("#profile-points")
        names = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]
        await show(*["down"] * names.index(point))
        save("profile")
        await show("2")
        save("search-done")
        await show("3")
        save("lock")
        await show("question_mark")
        save("help")
        await show("escape", "1", "t")  # the same profile in the light theme
        save("profile-light")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=RUN, help="finished run folder to open (default: %(default)s)")
    ap.add_argument("--point", default="boundary", help="the point selected in the Profile view (default: %(default)s)")
    ap.add_argument("--docs", default="docs/tui", help="where the SVGs go (default: %(default)s)")
    args = ap.parse_args()
    if not os.path.isdir(args.run):
        raise SystemExit(f"no run folder at {args.run}")
    docs = os.path.abspath(args.docs)
    os.makedirs(docs, exist_ok=True)
    asyncio.run(shoot(args.run, args.point, docs))


if __name__ == "__main__":
    main()
