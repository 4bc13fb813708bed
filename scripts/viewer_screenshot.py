"""Screenshots of `loomrl view` on a run folder (the README's and docs/viewer.md's images), in headless chromium.

    .venv/bin/python scripts/viewer_screenshot.py RUN [--out docs/images] [--chromium /usr/bin/chromium]

Writes viewer_curves.png (the dashboard), viewer_trajectory.png (a group opened into a trajectory, tokens coloured
by logprob) and viewer_timeline.png. Needs playwright (the dev extra) and Debian's chromium (`make chromium`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "viewer"))
from conftest import CHROMIUM, Viewer  # noqa: E402 - the tests' viewer-in-a-thread


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, default=Path("docs/images"))
    ap.add_argument("--chromium", default=CHROMIUM)
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    with Viewer([args.run]) as viewer, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        page.goto(viewer.url + "/")
        page.wait_for_function("window.loomrlView && loomrlView.ready && loomrlView.charts.reward")
        page.screenshot(path=str(args.out / "viewer_curves.png"), full_page=True)
        page.goto(viewer.url + "/?tab=trajectories")
        page.wait_for_selector(".group .member")
        page.locator(".member:has(.fate-trained)").first.click()  # a trained one: its advantage is not 0
        page.wait_for_function("document.querySelector('.legend') && "
                               "document.querySelector('.legend').textContent.includes('decoded with the run')",
                               timeout=120_000)
        page.select_option("#colour-by", "logprob")
        page.screenshot(path=str(args.out / "viewer_trajectory.png"), full_page=True)
        page.click("nav button[data-tab=timeline]")
        page.wait_for_selector("#timeline .lane")
        page.screenshot(path=str(args.out / "viewer_timeline.png"), full_page=False)
        browser.close()
    print(f"wrote {args.out}/viewer_curves.png, viewer_trajectory.png, viewer_timeline.png")


if __name__ == "__main__":
    main()
