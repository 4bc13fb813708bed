"""The viewer's page in a real headless chromium (Debian's, driven by playwright) served by a real uvicorn: the
dashboard of a real short run draws its curves (read back from uPlot's own data), a step's groups open into a
trajectory with coloured tokens (by the trainer's recorded logprob gap too), and the page of a run that is training
gains points as the run logs steps."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import RECIPE, Viewer, short_run

pytestmark = pytest.mark.browser

# Points per chart, as uPlot holds them: for each series, its non-null values.
POINTS = ("Object.fromEntries(Object.entries(loomrlView.charts).map(([id, c]) => "
          "[id, c.uplot.data.slice(1).map(s => s.filter(v => v != null).length)]))")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """The short run as a tiny mixture-of-experts model with router replay and the load-balancing term, so that the
    dashboard's MoE charts have a run's own figures too (the rest of the page is the same for a dense model)."""
    return short_run(tmp_path_factory.mktemp("runs"), "short", "model.tiny.arch=qwen3_moe", "trainer.router_replay=true",
                     "trainer.moe_aux_loss_coef=0.01")


@pytest.fixture(scope="module")
def page(run_dir, browser):  # the run first: playwright's sync API holds an event loop in this thread
    with Viewer([run_dir]) as viewer:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.viewer_url, page.errors = viewer.url, errors
        yield page
        page.close()


def test_the_dashboard_of_a_real_run_draws_curves_with_data_points(page):
    page.goto(page.viewer_url + "/")
    page.wait_for_function("window.loomrlView && loomrlView.ready")
    points = page.evaluate(POINTS)
    for chart in ("reward", "loss", "kl", "entropy", "grad_norm", "lag", "tps"):
        assert points[chart] and all(n == 2 for n in points[chart]), (chart, points)  # one per training step
    assert len(points["step_time"]) == 4 and all(n == 2 for n in points["step_time"])
    assert len(points["success"]) >= 3 and sum(points["success"]) >= 2 + 2  # train rate, eval before and after
    # the MoE figures (trainer/moe_step.py): agreement, the gap with and without replay, the aux loss, per step
    assert points["moe_agreement"] == [2] and points["moe_gap"] == [2, 2] and points["moe_aux"] == [2], points
    assert "adapter_version" not in points  # a run that publishes no adapter draws no adapter chart
    page.click("nav button[data-tab=pools]")
    page.wait_for_function("loomrlView.charts.engine_busy && loomrlView.charts.env_health")
    pools = page.evaluate(POINTS)
    assert all(n == 2 for n in pools["engine_busy"]) and all(n == 2 for n in pools["endings"])
    for chart in ("engine_busy_frac", "engine_queue", "prefix"):  # the engine's own metrics (engine/readings.py)
        assert pools[chart] == [2], (chart, pools)
    assert page.errors == []


def test_opening_a_group_shows_its_trajectories_with_coloured_tokens(page):
    page.goto(page.viewer_url + "/?tab=trajectories")
    page.wait_for_selector(".group .member")
    assert page.locator(".group").count() == 2  # the latest step's groups, side by side
    assert page.locator(".group").first.locator(".member").count() == 4
    assert "step 2" in page.locator("#f-step").evaluate("s => s.options[s.selectedIndex].text")
    page.locator(".member").first.click()
    page.wait_for_selector("#token-view .tok")
    assert page.locator(".ledger").inner_text().startswith("ledger: ")
    assert page.locator(".turn").count() >= 1
    tokens = page.locator("#token-view .tok")
    coloured = page.evaluate("[...document.querySelectorAll('#token-view .tok')].filter(t => t.style.background).length")
    assert 0 < coloured < tokens.count()  # the sampled tokens, not the prompt
    page.select_option("#colour-by", "logprob")
    hues = page.evaluate("[...document.querySelectorAll('#token-view .tok')].map(t => t.style.background)"
                         ".filter(b => b)")
    assert len(hues) == coloured and all(b.startswith("rgb") for b in hues)  # hsl() as the browser computes it
    # a trained member has a train record: the gap colouring is offered, on its sampled tokens
    page.locator(".member[title^='trained']").first.click()
    page.wait_for_function("[...document.querySelectorAll('#colour-by option')].some(o => o.value === 'gap')")
    page.select_option("#colour-by", "gap")
    page.wait_for_function("document.querySelector('.legend').textContent.includes('trainer − engine')")
    tokens = page.evaluate("[...document.querySelectorAll('#token-view .tok')].map(t => !!t.style.background)")
    assert 0 < sum(tokens) < len(tokens)  # the trained tokens, not the prompt
    page.wait_for_function("document.querySelector('.legend').textContent.includes('decoded with the run')",
                           timeout=60_000)  # ids first while the tokenizer loads, then the text
    assert not page.locator("#token-view .tok").first.inner_text().startswith("[")
    page.click("nav button[data-tab=timeline]")
    page.wait_for_selector("#timeline .lane")
    assert page.locator("#timeline .lane-row").count() == 4
    # each bar split by its slowest member's time: generating, waiting on tools, scoring (groups.jsonl's `slowest`)
    for part in ("generating", "waiting on tools", "scoring"):
        assert page.locator(f'#timeline .seg[data-part="{part}"]').count() == 4, part
    widths = page.evaluate("[...document.querySelectorAll('#timeline .seg[data-part=generating]')]"
                           ".map(s => s.getBoundingClientRect().width)")
    assert all(w > 0 for w in widths)
    assert page.errors == []


def test_a_live_runs_page_gains_points_while_it_trains(browser, tmp_path):
    run_dir = tmp_path / "live"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    train = subprocess.Popen(
        [sys.executable, "-m", "loomrl", "train", str(RECIPE), f"output_dir={tmp_path}", "name=live", "progress=false",
         "runtime.mode=sync", "trainer.total_steps=40", "eval.n_tasks=0", "checkpoint_every=0"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "config.yaml").is_file():
            assert train.poll() is None, f"the run failed: {train.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "the run did not start in 60 s"
            time.sleep(0.2)
        with Viewer([run_dir]) as viewer:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(viewer.url + "/?poll=300")
            count = "loomrlView.charts.reward ? loomrlView.charts.reward.uplot.data[0].length : 0"
            page.wait_for_function(f"({count}) >= 1", timeout=60_000)
            first = page.evaluate(count)
            page.wait_for_function(f"({count}) > {first}", timeout=60_000)
            assert page.evaluate(count) > first
            assert "following: live" in page.locator("#live").inner_text()
            page.close()
    finally:
        train.terminate()
        train.wait(timeout=30)


def test_several_runs_are_overlaid_on_each_chart(browser, run_dir, tmp_path):
    other = tmp_path / run_dir.name  # the same name from another folder: keyed apart
    shutil.copytree(run_dir, other)
    with Viewer([run_dir, other]) as viewer:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(viewer.url + "/")
        page.wait_for_function("window.loomrlView && loomrlView.ready && loomrlView.charts.reward")
        labels = page.evaluate("loomrlView.charts.reward.uplot.series.slice(1).map(s => s.label)")
        assert labels == [f"{run_dir.name} · rollout/reward_mean", f"{run_dir.name}~2 · rollout/reward_mean"]
        assert page.evaluate(POINTS)["reward"] == [2, 2]
        page.close()
