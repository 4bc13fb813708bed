"""A web episode in the viewer: its steps (readable actions, observations), its env_record's verdict, and the
screenshot each step left, fetched one at a time from files beside the store (loomrl/store/screenshots.py), never
carried by the list. The run folder is made here, not by a browser episode: a group of two web trajectories as the
web environment records them (env/tasks/web/environment.py), one with two small JPEGs (after reset, after its one
executed action), one without screenshots. Through the API (FastAPI's test client) and the page (headless chromium)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pyarrow.parquet as pq
import pytest
from conftest import Viewer
from fastapi.testclient import TestClient

from loomrl.store.trajectory_store import TrajectoryStore
from loomrl.types import TokenSpan, Trajectory, Turn
from loomrl.view.app import create_app

PAGE = "Shop home\n[12] link \"Cart\"\n" + "\n".join(f"[{i}] link \"Product {i}\"" for i in range(20, 80))
CART = "Cart\n[31] button \"Checkout\"\n" + "\n".join(f"[{i}] link \"Lamp {i}\" 12.50" for i in range(40, 90))


def _jpeg(colour: str) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (64, 36), colour).save(out, "JPEG", quality=50)
    return out.getvalue()


SHOTS = [_jpeg("red"), _jpeg("blue")]


def _call(name: str, error: str | None = None, **arguments) -> dict:
    call = {"name": name, "arguments": arguments, "error": None}
    if error:
        call["tool_error"], call["failure"] = error, "not_found"
    return call


def _web(trajectory_id: str, shots: list[bytes]) -> Trajectory:
    """Two steps: a click on an id not on the page (the model's mistake: a tool error, no screenshot), then a click
    that opens the cart (a screenshot); then the answer."""
    turns = [Turn(act="click(999)", obs="Error: no element [999] on the page", act_span=TokenSpan(start=3, end=4),
                  logprobs=[-0.5], versions=[0], tool_calls=[_call("click", "no element [999] on the page",
                                                                   element=999)]),
             Turn(act="click(12)", obs=CART, act_span=TokenSpan(start=5, end=6), logprobs=[-0.2], versions=[0],
                  tool_calls=[_call("click", element=12)]),
             Turn(act="answer(done)", act_span=TokenSpan(start=7, end=8), logprobs=[-0.1], versions=[0], done=True)]
    record: dict = {"solved": bool(shots), "reason": "the cart holds the lamp" if shots else "no order placed",
                    "url": "http://shop-1.loomrl.test/cart"}
    if shots:
        record["screenshots"] = [base64.b64encode(s).decode() for s in shots]
    return Trajectory(task_id="web-buy-00001", trajectory_id=trajectory_id, group_id="group-web", split="train",
                      prompt=f"Put the lamp in the cart.\n\n{PAGE}", prompt_ids=[1, 2, 3],
                      token_ids=list(range(1, 9)), turns=turns, total_reward=float(bool(shots)),
                      reward_components={"correct": float(bool(shots))}, env_record=record)


def _store(store: Path, trajectories: list[Trajectory]) -> None:
    """The trajectories as the rollout worker stores them (their screenshots to files beside the parts)."""
    writer = TrajectoryStore(store)
    writer.append(trajectories)
    writer.flush()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "web"
    run.mkdir()
    (run / "config.yaml").write_text("env: {name: web, args: {screenshots: true}}\n")
    (run / "metrics.jsonl").write_text("")
    _store(run / "trajectories", [_web("traj-shots", SHOTS), _web("traj-plain", [])])
    return run


@pytest.fixture(scope="module")
def client(run_dir):
    return TestClient(create_app([run_dir]))


def test_the_store_keeps_screenshots_as_files_and_the_list_never_carries_them(client, run_dir):
    stored = pq.read_table(run_dir / "trajectories").column("env_record").to_pylist()
    assert json.loads(stored[0]) == {"solved": True, "reason": "the cart holds the lamp",
                                     "url": "http://shop-1.loomrl.test/cart", "screenshots": 2}
    listing = client.get("/api/groups", params={"run": "web", "step": -1})
    assert listing.status_code == 200 and len(listing.json()["groups"][0]["members"]) == 2
    for shot in SHOTS:
        assert base64.b64encode(shot).decode()[:40] not in listing.text


def test_a_web_trajectory_has_its_verdict_readable_actions_and_screenshots_by_step(client):
    d = client.get("/api/trajectory", params={"run": "web", "id": "traj-shots"}).json()
    assert d["env"] == {"solved": True, "reason": "the cart holds the lamp", "url": "http://shop-1.loomrl.test/cart",
                        "screenshots": 2}
    assert "env_record" not in d["trajectory"]
    calls = [c for t in d["contexts"][-1]["turns"] for c in t["tool_calls"]]
    assert [(c["action"], c["screenshot"]) for c in calls] == [("click [999]", None), ("click [12]", 1)]
    for i, shot in enumerate(SHOTS):
        r = client.get("/api/screenshot", params={"run": "web", "id": "traj-shots", "i": i})
        assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg" and r.content == shot
    assert client.get("/api/screenshot", params={"run": "web", "id": "traj-shots", "i": 2}).status_code == 404
    assert client.get("/api/screenshot", params={"run": "web", "id": "../traj-shots", "i": 0}).status_code == 404
    plain = client.get("/api/trajectory", params={"run": "web", "id": "traj-plain"}).json()
    assert plain["env"]["screenshots"] == 0 and plain["env"]["solved"] is False
    assert [c["screenshot"] for t in plain["contexts"][-1]["turns"] for c in t["tool_calls"]] == [None, None]


@pytest.mark.browser
def test_the_page_shows_a_web_episode_step_by_step_with_its_screenshots(run_dir, browser):
    with Viewer([run_dir]) as viewer:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        asked: list[str] = []
        page.on("request", lambda r: asked.append(r.url) if "/api/screenshot" in r.url else None)
        try:
            page.goto(viewer.url + "/?tab=trajectories")
            page.select_option("#f-step", "-1")
            page.locator(".member[data-id=traj-shots]").click()
            page.wait_for_selector("#trajectory .env-record")
            box = page.locator("#trajectory")
            page.wait_for_timeout(300)  # the task's page text fills the screen: no step is in view yet
            assert asked == [] and box.locator("img.shot[src]").count() == 0
            text = box.inner_text()
            assert "solved · the cart holds the lamp · at http://shop-1.loomrl.test/cart" in text
            assert "action: click [999]" in text and "action: click [12]" in text
            assert "Error: no element [999] on the page" in text
            long = box.locator("details.obs")  # the cart's page text is long: folded, its first line showing
            assert long.count() == 1 and "Checkout" not in text and long.locator("summary").inner_text().startswith("Cart")
            long.locator("summary").click()
            assert "Checkout" in long.inner_text()
            shots = box.locator("img.shot")
            assert shots.count() == 2 and [shots.nth(k).get_attribute("data-i") for k in (0, 1)] == ["0", "1"]
            for k in (0, 1):
                shots.nth(k).scroll_into_view_if_needed()
            page.wait_for_function("[...document.querySelectorAll('#trajectory img.shot')]"
                                   ".every(i => i.complete && i.naturalWidth === 64)")
            # each asked for by its own step (a view drawn again while the tokenizer loads may ask again)
            asked_for = {(q["id"][0], q["i"][0]) for q in (parse_qs(urlsplit(u).query) for u in asked)}
            assert asked_for == {("traj-shots", "0"), ("traj-shots", "1")}
            page.locator(".member[data-id=traj-plain]").click()
            page.wait_for_function("document.querySelector('#trajectory').innerText.includes('no order placed')")
            assert box.locator("img").count() == 0 and "not solved" in box.inner_text()
            assert errors == []
        finally:
            page.close()
