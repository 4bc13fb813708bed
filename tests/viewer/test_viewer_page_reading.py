"""What the page draws can be read right, in a real headless chromium over a real uvicorn: two runs side by side (the
short run, and a copy as a one-split run logs it, with a pending group whose reward failed), read back from uPlot's
own series and axes and from the DOM: each run's lines have its badge's colour; policy lag in steps and the count of
groups per lag are charts apart; a one-split run draws its held-out success once; the step axis ticks whole steps;
a trajectory shows its task's question, and "decoding…" rather than token ids while the run's tokenizer loads; a
member whose reward failed is labelled so.

The tokenizer's load is held back until the test that needs it loading releases it (it is the real loader, started
late): that is the only stand-in here."""

from __future__ import annotations

import re
import threading

import pyarrow.parquet as pq
import pytest
from conftest import Viewer, add_reward_failed_group, one_split_copy

pytestmark = pytest.mark.browser

HOLD_S = 120  # the longest a held tokenizer load waits for the test to release it

# Per chart, each series' label, its stroke and dash as uPlot holds them, and the x axis' tick labels as drawn.
CHARTS = """Object.fromEntries(Object.entries(loomrlView.charts).map(([id, c]) => { const u = c.uplot;
  return [id, { series: u.series.slice(1).map((s, i) => ({ label: s.label, dash: s.dash || null,
    stroke: typeof s.stroke === "function" ? s.stroke(u, i + 1) : s.stroke })), xticks: u.axes[0]._values }]; }))"""
# A CSS colour as the browser computes it ("rgb(31, 119, 180)"), to compare a hex stroke with a badge's background.
# The step list is the chosen run's (fillSteps signs it `run:steps:pending`; every run's list has a "-1" option).
STEPS_OF = "run => (document.querySelector('#f-step').dataset.sig || '').startsWith(run + ':')"
RGB = """c => { const e = document.createElement("span"); e.style.color = c; document.body.append(e);
  const v = getComputedStyle(e).color; e.remove(); return v; }"""


@pytest.fixture(scope="module")
def runs(run_dir, tmp_path_factory):
    other = one_split_copy(run_dir, tmp_path_factory.mktemp("other") / "onesplit")
    return run_dir, other, add_reward_failed_group(other)


@pytest.fixture(scope="module")
def release():
    """Hold every tokenizer load of this module's viewer until set (the real loader then runs)."""
    from loomrl.view.tokens import TokenText

    go, load = threading.Event(), TokenText._load

    def held(self):
        if not go.wait(HOLD_S):
            raise TimeoutError(f"the test did not release the tokenizer in {HOLD_S} s")
        return load(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TokenText, "_load", held)
        yield go
        go.set()


@pytest.fixture(scope="module")
def page(runs, release, browser):
    run_dir, other, _ = runs
    with Viewer([run_dir, other]) as viewer:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(viewer.url + "/")
        page.wait_for_function("window.loomrlView && loomrlView.ready && loomrlView.charts.reward")
        page.viewer_url, page.errors = viewer.url, errors
        yield page
        page.close()


def test_each_runs_lines_have_its_badges_colour(page, runs):
    badges = page.evaluate("Object.fromEntries([...document.querySelectorAll('#runs .run-chip')]"
                           ".map(b => [b.textContent, getComputedStyle(b).backgroundColor]))")
    assert set(badges) == {r.name for r in runs[:2]} and len(set(badges.values())) == 2
    charts = page.evaluate(CHARTS)
    for chart, c in charts.items():
        for s in c["series"]:
            run = s["label"].split(" · ")[0]
            assert page.evaluate(RGB, s["stroke"]) == badges[run], (chart, s)
        for run in badges:  # a run's metrics in one chart: told apart by dash
            dashes = [str(s["dash"]) for s in c["series"] if s["label"].startswith(run + " · ")]
            assert len(set(dashes)) == len(dashes), (chart, dashes)
    assert len(charts["step_time"]["series"]) == 8  # four metrics a run: each run's four in its colour


def test_policy_lag_in_steps_and_groups_per_lag_are_charts_apart(page):
    charts = page.evaluate(CHARTS)
    lag = {s["label"].split(" · ")[1] for s in charts["lag"]["series"]}
    assert lag == {"staleness_max", "derived/staleness_mean"}  # steps only: no count of groups on this axis
    counts = {s["label"].split(" · ")[1] for s in charts["lag_groups"]["series"]}
    assert counts == {"staleness/lag_0"}  # sync: every group at lag 0
    assert page.evaluate("loomrlView.charts.lag_groups.uplot.data.slice(1)") == [[2, 2]] * 2  # 2 groups a step
    assert page.evaluate("loomrlView.charts.lag.uplot.data.slice(1)") == [[0, 0]] * 4  # steps: max, mean per run


def test_a_one_split_run_draws_its_held_out_success_once(page, runs):
    run_dir, other, _ = runs
    labels = [s["label"] for s in page.evaluate(CHARTS)["success"]["series"]]
    held_out = lambda run: sorted(x.split(" · ")[1] for x in labels if x.startswith(run.name + " · eval/"))  # noqa: E731
    assert held_out(other) == ["eval/heldout/success"]
    # two splits: each, and over both together
    assert held_out(run_dir) == ["eval/heldout/success", "eval/heldout_templates/success", "eval/success"]


def test_the_step_axis_ticks_whole_steps(page):
    charts = page.evaluate(CHARTS)
    assert charts["reward"]["xticks"] == ["1", "2"]
    assert charts["success"]["xticks"] == ["0", "1", "2"]  # evaluation before training is at step 0
    for chart, c in charts.items():
        assert all(re.fullmatch(r"\d*", t) for t in c["xticks"]), (chart, c["xticks"])
    assert page.errors == []


def test_a_trajectory_shows_its_question_and_decoding_until_the_tokenizer_loads(page, runs, release):
    run_dir = runs[0]
    prompts = dict(zip(*pq.read_table(run_dir / "trajectories", columns=["trajectory_id", "prompt"]).to_pydict()
                       .values()))
    page.goto(page.viewer_url + "/?tab=trajectories")
    page.wait_for_selector(".group .member")
    member = page.locator(".member").first
    tid = member.get_attribute("data-id")
    member.click()
    page.wait_for_selector("#token-view .tokens")
    assert page.locator(".question").inner_text().endswith(prompts[tid])
    view = page.locator("#token-view").inner_text()
    assert "decoding…" in view and not re.search(r"\[\d+\]", view)  # the tokenizer is held: no ids as text
    assert page.locator("#token-view .tok").count() == 0
    release.set()
    page.wait_for_function("document.querySelector('.legend').textContent.includes('decoded with the run')",
                           timeout=60_000)  # the page asked again
    assert page.locator("#token-view .tok").count() > 0 and "decoding…" not in page.locator("#token-view").inner_text()
    assert page.locator(".question").inner_text().endswith(prompts[tid])


def test_a_member_whose_reward_failed_is_labelled_so(page, runs):
    _, other, ids = runs
    page.goto(page.viewer_url + "/?tab=trajectories")
    page.wait_for_selector(".group .member")
    page.select_option("#f-run", other.name)
    page.wait_for_function(STEPS_OF, arg=other.name)
    page.select_option("#f-step", "-1")
    failed = page.locator(f".member[data-id={ids['failed']}]")
    failed.wait_for()
    assert "reward_failed" in failed.inner_text() and "completed" not in failed.inner_text()
    assert "reward_failed 0.000" not in failed.inner_text() and "no terms" in failed.inner_text()
    assert page.errors == []


def test_a_late_answer_for_filters_no_longer_chosen_is_not_drawn(page, runs):
    """Switching the run asks for its groups at once; choosing a step right after asks again. The first answer held
    back until the second is drawn (as a loaded server may answer) must not replace it: the page draws only the
    answer to what is chosen now. (Held by Playwright's request routing: the server itself is not stubbed.)"""
    _, other, ids = runs
    page.goto(page.viewer_url + "/?tab=trajectories")
    page.wait_for_selector(".group .member")
    held = []
    page.route("**/api/groups?*", lambda route: route.continue_() if "step=-1" in route.request.url
               else held.append(route))
    try:
        page.select_option("#f-run", other.name)
        page.wait_for_function(STEPS_OF, arg=other.name)
        page.select_option("#f-step", "-1")
        failed = page.locator(f".member[data-id={ids['failed']}]")
        failed.wait_for()
        assert held, "the run switch's own request was not held"
        for route in held:
            with page.expect_response(lambda r, url=route.request.url: r.url == url) as answer:
                route.continue_()
            answer.value.finished()
        page.wait_for_timeout(300)  # the page has read the late answers: drawn them, or rightly dropped them
        assert failed.is_visible()
    finally:
        page.unroute("**/api/groups?*")
