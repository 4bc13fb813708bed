"""The viewer's HTTP app: a JSON API over run folders and the static page that draws it.

Endpoints (all GET; `run` is a run's key from /api/runs):
  /api/runs                                    the runs: name, folder, config essentials, summary once ended (and
                                               starts loading each run's tokenizer, for the trajectories)
  /api/metrics?run=&since=N                    metrics.jsonl records from line N on, and the next N (the page polls)
  /api/steps?run=                              per ledger step: trained, skipped by reason, stale; pending count
  /api/groups?run=&store=&step=&status=&task=&min_reward=&max_reward=&limit=
                                               group cards (groups.py); step=-1: groups not consumed yet
  /api/trajectory?run=&id=&store=              one trajectory: its task's question (prompt), how it ended, turns,
                                               tool calls, per-token ids/text/mask/logprob/version (and gap, when
                                               recorded), its advantage (as trained when train_records.jsonl has
                                               it, else computed), its ledger fate; a web episode's verdict (`env`:
                                               solved, reason, url, screenshots stored) and per tool call its
                                               readable `action` and `screenshot` index (web_steps.py)
  /api/screenshot?run=&id=&store=&i=           one stored screenshot of a web episode (image/jpeg; 0: after reset):
                                               the page asks for each only when its step is on screen
  /api/timeline?run=                           each group's lifecycle (groups.jsonl) with the step that consumed it
What it is not: a writer (it never changes a run folder) or a tracker across machines (it reads local folders).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

from loomrl.store.screenshots import read_env_record
from loomrl.view.groups import (
    GroupFilter,
    advantage_rule,
    advantages,
    filtered_groups,
    recorded_advantage,
    trained_source,
)
from loomrl.view.run_folder import TRAINING_STORE, RunFolderError, RunReader
from loomrl.view.tokens import TokenText, token_gaps
from loomrl.view.web_steps import annotate_steps, env_summary

STATIC = Path(__file__).parent / "static"
# How long a trajectory waits for its run's tokenizer to load (transformers' import alone takes seconds) before it
# answers without the text (`pieces` None, `tokenizer_loading` true: the page shows "decoding…", never the ids, and
# asks again). /api/runs starts every run's load when the page opens, so this is rare.
TOKENIZER_WAIT_S = 1.0


class Runs:
    """The runs the viewer was given, by key (the folder's name; a second folder of the same name gets `name~2`)."""

    def __init__(self, paths: list[Path]):
        self.by_key: dict[str, RunReader] = {}
        self.tokens: dict[str, TokenText] = {}
        for path in paths:
            run = RunReader(path)
            key, n = run.name, 1
            while key in self.by_key:
                n += 1
                key = f"{run.name}~{n}"
            self.by_key[key] = run

    def get(self, key: str) -> RunReader:
        if key not in self.by_key:
            raise HTTPException(404, f"no run '{key}'; the viewer has {sorted(self.by_key)}")
        return self.by_key[key]

    def token_text(self, key: str) -> TokenText:
        if key not in self.tokens:
            run = self.get(key)
            self.tokens[key] = TokenText(run.path, run.config())
        return self.tokens[key]


def _essentials(config: dict[str, Any]) -> dict[str, Any]:
    model, trainer, runtime, env = (config.get(k) or {} for k in ("model", "trainer", "runtime", "env"))
    return {"model": model.get("path") or model.get("kind"), "env": env.get("name"), "mode": runtime.get("mode"),
            "total_steps": trainer.get("total_steps"), "group_size": trainer.get("group_size"),
            "groups_per_step": trainer.get("groups_per_step"), "advantage_rule": advantage_rule(config)}


def create_app(paths: list[Path]) -> FastAPI:
    runs = Runs([Path(p) for p in paths])
    app = FastAPI(title="loomrl view", docs_url=None, redoc_url=None)

    def store(run: RunReader, name: str):
        try:
            return run.store(name)
        except RunFolderError as err:
            raise HTTPException(404, str(err)) from None

    @app.get("/api/runs")
    def api_runs() -> list[dict[str, Any]]:
        out = []
        for key, run in runs.by_key.items():
            # The page has just opened: start loading the run's tokenizer now (importing transformers and loading one
            # takes seconds), so that it is there by the time a trajectory is opened
            runs.token_text(key).warm()
            config = run.config()
            out.append({"key": key, "name": run.name, "path": str(run.path), "config": _essentials(config),
                        "summary": run.summary(), "live": run.live(), "stores": run.store_names()})
        return out

    @app.get("/api/metrics")
    def api_metrics(run: str, since: int = Query(0, ge=0)) -> dict[str, Any]:
        records = runs.get(run).metrics.read()
        return {"records": records[since:], "next": len(records)}

    @app.get("/api/steps")
    def api_steps(run: str) -> dict[str, Any]:
        folder = runs.get(run)
        steps = [{"step": e.step, "trained": len(e.trained), "skipped": {k: len(v) for k, v in e.skipped.items()},
                  "stale": len(e.stale)} for e in folder.steps()]
        fates = folder.fates()
        pending = sum(1 for r in folder.store().rows() if r.trajectory_id not in fates)
        return {"steps": steps, "pending": pending, "stored": len(folder.store().rows())}

    @app.get("/api/groups")
    def api_groups(run: str, store_name: str = Query(TRAINING_STORE, alias="store"), step: int | None = None,
                   status: str | None = None, task: str | None = None, min_reward: float | None = None,
                   max_reward: float | None = None, limit: int = Query(64, ge=1, le=1000)) -> dict[str, Any]:
        folder = runs.get(run)
        rows = store(folder, store_name).rows()
        fates = folder.fates() if store_name == TRAINING_STORE else {}
        records = folder.records() if store_name == TRAINING_STORE else {}
        flt = GroupFilter(step=step, status=status, task=task, min_reward=min_reward, max_reward=max_reward)
        groups = filtered_groups(rows, fates, flt, records)
        runs.token_text(run).warm()  # a trajectory is likely opened next
        return {"groups": groups[:limit], "total": len(groups), "advantage_rule": advantage_rule(folder.config())}

    @app.get("/api/trajectory")
    def api_trajectory(run: str, id: str, store_name: str = Query(TRAINING_STORE, alias="store")) -> dict[str, Any]:
        folder = runs.get(run)
        index = store(folder, store_name)
        row, record = index.get(id), index.read(id)
        if row is None or record is None:
            raise HTTPException(404, f"run {run}: no trajectory '{id}' in its store '{store_name}'")
        group = [r for r in index.rows() if r.group_id == record["group_id"]]
        adv = dict(zip((r.trajectory_id for r in group), advantages([r.total_reward for r in group]))).get(id)
        fate = folder.fates().get(id) if store_name == TRAINING_STORE else None
        trained = folder.records().get(id) if store_name == TRAINING_STORE else None
        text = runs.token_text(run)
        loading = not text.loaded(TOKENIZER_WAIT_S)
        contexts: list[dict[str, Any]] = [*record.get("segments", []), {"reason": "", **{k: record[k] for k in (
            "token_ids", "loss_mask", "logprobs", "versions", "turns", "prompt_len")}}]
        recorded_gaps = trained["gaps"] if trained is not None else []
        for k, ctx in enumerate(contexts):
            ctx["pieces"] = None if loading else text.pieces(ctx["token_ids"])
            ctx["gap"] = token_gaps(ctx["loss_mask"], recorded_gaps[k] if k < len(recorded_gaps) else None)
        if trained is not None:
            adv, source = recorded_advantage(trained), trained_source(trained["step"])
            gap = (f"recorded at step {trained['step']}: |trainer - engine| logprob per sampled token, the trainer's "
                   "before that step's update (colour by gap)")
        else:
            source = "computed (see the group card)" if adv is not None else ""
            gap = ("none: an evaluation episode is never trained" if store_name != TRAINING_STORE
                   else "not recorded: the run has no train_records.jsonl (written by runs since the viewer showed it)"
                   if not folder.records() else "not recorded: this trajectory was not trained")
        env = env_summary(read_env_record(record.get("env_record")))
        annotate_steps(contexts, env["screenshots"] if env is not None else 0)
        shown = {k: v for k, v in record.items() if k not in (
            "token_ids", "loss_mask", "logprobs", "versions", "turns", "segments", "prompt_len", "env_record")}
        # how it ended, and its terms without the reward_failed marker (store_index.IndexRow)
        shown.update(status=row.ending, reward_components=row.terms)
        return {
            "trajectory": shown,  # with the task's question (`prompt`), its answer and split
            "contexts": contexts,  # earlier context segments first, the current one last
            "advantage": adv, "advantage_source": source,
            "advantages": trained["advantages"] if trained is not None else None,  # per turn, as trained
            "tokenizer": ("decoding…: the run's tokenizer is still loading" if loading
                          else text.reason or "decoded with the run's tokenizer"),
            "tokenizer_loading": loading,
            "logprob_gap": gap,
            "fate": None if fate is None else {"step": fate.step, "fate": fate.fate, "reason": fate.reason},
            "env": env,  # a web episode's verdict and screenshot count (None: the environment recorded none)
        }

    @app.get("/api/screenshot")
    def api_screenshot(run: str, id: str, i: int = Query(ge=0),
                       store_name: str = Query(TRAINING_STORE, alias="store")) -> FileResponse:
        path = store(runs.get(run), store_name).screenshot(id, i)
        if path is None:
            raise HTTPException(404, f"run {run}: no screenshot {i} of trajectory '{id}' in its store '{store_name}'")
        # a stored screenshot never changes: the browser may keep it
        return FileResponse(path, media_type="image/jpeg", headers={"Cache-Control": "max-age=86400, immutable"})

    @app.get("/api/timeline")
    def api_timeline(run: str) -> dict[str, Any]:
        folder = runs.get(run)
        events = folder.group_events.read()
        fates = folder.fates()
        out = []
        for e in events:
            ids = e.get("trajectory_ids", [])
            consumed = [fates[t] for t in ids if t in fates]
            out.append({**{k: v for k, v in e.items() if k != "trajectory_ids"},
                        "step": consumed[0].step if consumed else None,
                        "fate": consumed[0].fate if consumed else "pending"})
        recorded = folder.folder.groups.is_file()
        return {"groups": out, "recorded": recorded}

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/favicon.ico")
    def favicon() -> Response:
        return Response(status_code=204)  # none: without this route a browser logs a 404 on every page

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
