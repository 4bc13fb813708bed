"""The metric sinks on short sequences of records, the fan-out with a failing sink, the `metrics:` section's errors,
and W&B offline for real: a tiny training run leaves an offline W&B run in its folder holding the logged metrics.

W&B's files are read back as wandb itself writes them (`read_wandb_file`): a .wandb file is a LevelDB-format log (a
7-byte header `:W&B`, magic 0xBEE1, version 0; then 32 KiB blocks of chunks, each with a 7-byte header: crc32, length,
type full/first/middle/last), each record one `wandb.proto.wandb_internal_pb2.Record`, the message wandb-core reads
when `wandb sync` uploads the file. wandb 0.30 ships no Python reader of it (wandb.sdk.internal.datastore is gone).
"""

from __future__ import annotations

import json
import logging
import math
import socket
import struct
import urllib.request
from pathlib import Path

import pytest

from loomrl.config import ConfigError, build_config
from loomrl.config.metrics import MetricsConfig, PrometheusConfig, WandbConfig
from loomrl.metrics import MetricsLogger, open_metrics, read_metrics
from loomrl.metrics.jsonl import JsonlSink
from loomrl.metrics.prometheus import PrometheusSink, gauge_name
from loomrl.metrics.sink import SinkError, Values
from loomrl.runtime.checks import load_checked

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"

RECORDS = [(0, "eval_before", {"eval/success": 0.25, "eval/n": 4}),
           (1, "train", {"train/loss": 0.5, "groups": 2, "rollout/reward_mean": float("nan")}),
           (2, "train", {"train/loss": 0.25, "groups": 2}),
           (1, "rollback", {"reason": "trainer_restart"}),
           (2, "train", {"train/loss": 0.125, "groups": 2}),
           (2, "eval_after", {"eval/success": 0.75, "eval/n": 4})]


def log_all(sink) -> None:
    for step, kind, values in RECORDS:
        sink.log(step, kind, values)


# -- metrics.jsonl ------------------------------------------------------------------------------------------------

def test_jsonl_lines_are_kind_step_time_then_the_values_as_logged(tmp_path, monkeypatch):
    monkeypatch.setattr("time.time", lambda: 1700000000.5)
    sink = JsonlSink(tmp_path)
    log_all(sink)
    sink.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    # the exact bytes the file has always had: what read_metrics, the summary and older runs' readers expect
    assert lines[1] == ('{"kind": "train", "step": 1, "time": 1700000000.5, "train/loss": 0.5, "groups": 2, '
                        '"rollout/reward_mean": NaN}')
    assert lines[3] == '{"kind": "rollback", "step": 1, "time": 1700000000.5, "reason": "trainer_restart"}'
    kept = read_metrics(tmp_path)  # the step 2 undone by the rollback is left out
    assert [(r["kind"], r["step"]) for r in kept] == [("eval_before", 0), ("train", 1), ("rollback", 1),
                                                      ("train", 2), ("eval_after", 2)]
    assert len(read_metrics(tmp_path, superseded=True)) == len(RECORDS)


# -- Prometheus ---------------------------------------------------------------------------------------------------

def test_prometheus_serves_the_latest_value_of_each_metric_as_a_gauge(tmp_path):
    sink = PrometheusSink(PrometheusConfig(port=0), run_name="tiny")
    try:
        log_all(sink)
        with urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        sink.close()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(samples['loomrl_train_loss{run="tiny"}']) == 0.125
    assert float(samples['loomrl_train_groups{run="tiny"}']) == 2
    assert float(samples['loomrl_eval_success{run="tiny"}']) == 0.75
    assert float(samples['loomrl_step{kind="train",run="tiny"}']) == 2
    assert not any("reward_mean" in name for name in samples)  # NaN is no value, in any sink but the JSONL
    assert gauge_name("eval/heldout/success") == "loomrl_eval_heldout_success"


def test_a_busy_prometheus_port_stops_the_run_before_it_starts_and_names_the_field(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(SinkError, match=r"metrics.prometheus: cannot serve on 127.0.0.1:\d+ .*"
                                               r"metrics.prometheus.port"):
            open_metrics(tmp_path, MetricsConfig(prometheus=PrometheusConfig(port=busy.getsockname()[1])))


def test_a_run_whose_sink_cannot_start_stops_before_it_trains_with_one_run_error(tmp_path):
    from loomrl.runtime.failures import RunError
    from loomrl.runtime.run import train

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cfg = load_checked(RECIPE, [f"output_dir={tmp_path}", "progress=false",
                                   f"metrics.prometheus.port={busy.getsockname()[1]}"])
        with pytest.raises(RunError, match=r"^run error: metrics.prometheus: cannot serve on"):
            train(cfg)
    assert not (cfg.run_dir / "ledger.jsonl").exists()


# -- the fan-out --------------------------------------------------------------------------------------------------

class _Recorder:
    name = "recorder"

    def __init__(self):
        self.records, self.closed = [], False

    def log(self, step: int, kind: str, metrics: Values) -> None:
        self.records.append((step, kind, dict(metrics)))

    def close(self) -> None:
        self.closed = True


class _Broken:
    """A sink whose service is down (W&B raising, say): every call raises."""
    name = "metrics.broken"

    def log(self, step: int, kind: str, metrics: Values) -> None:
        raise ConnectionError("the dashboard is down")

    def close(self) -> None:
        raise ConnectionError("the dashboard is still down")


def test_a_failing_sink_is_warned_about_once_and_stops_neither_the_run_nor_the_others(tmp_path, caplog):
    before, after = _Recorder(), _Recorder()
    logger = MetricsLogger([before, _Broken(), JsonlSink(tmp_path), after])
    with caplog.at_level(logging.WARNING, logger="loomrl"):
        for step, kind, values in RECORDS:
            logger.log(step, values, kind=kind)
        logger.close()
    assert before.records == after.records == [(s, k, v) for s, k, v in RECORDS]
    assert before.closed and after.closed
    assert len(read_metrics(tmp_path, superseded=True)) == len(RECORDS)
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["metrics: metrics.broken failed; the run and the other sinks go on (further failures are "
                        "counted, not shown)",
                        "metrics: metrics.broken failed 7 time(s) in this run; its records are incomplete "
                        "(metrics.jsonl has them all)"]


# -- the metrics: section -----------------------------------------------------------------------------------------

def test_the_metrics_section_names_its_bad_fields():
    cfg = build_config({})
    assert cfg.metrics.tensorboard and cfg.metrics.prometheus is None and cfg.metrics.wandb is None
    with pytest.raises(ConfigError, match=r"'metrics.wandb.mode': Input should be 'online', 'offline' or 'disabled'"):
        load_checked(None, ["metrics.wandb.mode=ofline"])
    with pytest.raises(ConfigError, match=r"'metrics.prometheus.port': Input should be less than or equal to 65535"):
        load_checked(None, ["metrics.prometheus.port=70000"])
    with pytest.raises(ConfigError, match=r"unknown field 'metrics.wandb.projct'; did you mean 'project'"):
        load_checked(None, ["metrics.wandb.projct=x"])
    cfg = load_checked(None, ["metrics.wandb.project=p", "metrics.wandb.tags=[a, b]", "metrics.wandb.mode=disabled",
                             "metrics.tensorboard=false"])  # disabled: loads without wandb installed too
    assert cfg.metrics.wandb == WandbConfig(project="p", tags=["a", "b"], mode="disabled")
    assert not cfg.metrics.tensorboard


def test_metrics_wandb_without_wandb_installed_is_one_line_naming_the_field_and_the_extra(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ConfigError) as err:
        load_checked(None, ["metrics.wandb.mode=offline"])
    assert str(err.value) == ("config error: metrics.wandb: W&B logging needs the wandb package: "
                              "pip install 'loomrl[wandb]' (or remove metrics.wandb)")
    load_checked(None, ["metrics.wandb.mode=disabled"])  # a recipe may keep its section switched off


# -- W&B, offline ---------------------------------------------------------------------------------------------------

def read_wandb_file(path: Path):
    """The records of a .wandb file, in order (the format: this module's docstring)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, at, block, chunks = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    while at + 7 <= len(data):
        if block - at % block < 7:  # a block's tail too short for a header is padding
            at += block - at % block
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, at)
        chunk, at = data[at + 7: at + 7 + length], at + 7 + length
        if kind == 0:
            continue
        chunks = chunk if kind in (1, 2) else chunks + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            yield Record.FromString(chunks)


def wandb_run(run_folder: Path) -> dict:
    """The offline W&B runs under `run_folder`/wandb/: id, config, tags and history rows ({name: value}, W&B's own
    `_step`, `_runtime`, `_timestamp` left out), the runs' files in the order they were written."""
    import wandb

    # run.finish() can return before wandb-core has flushed the file (seen here: 1 read in 3 found no records; its
    # debug log showed the stream closing ms after finish() returned); the service's shutdown waits for it, as
    # wandb's atexit hook does when a run's process ends
    wandb.teardown()
    out: dict = {"ids": [], "rows": [], "config": {}, "tags": []}
    for path in sorted(run_folder.glob("wandb/offline-run-*/run-*.wandb")):
        for record in read_wandb_file(path):
            which = record.WhichOneof("record_type")
            if which == "run":
                out["ids"].append(record.run.run_id)
                out["config"] = {item.key: json.loads(item.value_json) for item in record.run.config.update}
                out["tags"], out["name"] = list(record.run.tags), record.run.display_name
            elif which == "history":
                row = {(item.nested_key[0] if item.nested_key else item.key): json.loads(item.value_json)
                       for item in record.history.item}
                out["rows"].append({k: v for k, v in row.items() if not k.startswith("_")})
    return out


@pytest.fixture
def offline_wandb(monkeypatch):
    """W&B with no network: offline mode, and nothing it may reach out for on its own (error reports, system stats
    and cloud metadata probes, git). The Python side's sockets may connect to this machine only; wandb-core (a Go
    process) talks to it over a Unix socket, and its own sockets are beyond this check."""
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'loomrl[wandb]'; `make test` does)")
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
                        "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true", "WANDB_X_DISABLE_STATS": "true",
                        "WANDB_X_DISABLE_META": "true", "WANDB_X_DISABLE_MACHINE_INFO": "true",
                        "WANDB_API_KEY": ""}.items():
        monkeypatch.setenv(name, value)
    connect = socket.socket.connect
    reached: list = []

    def local_only(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            reached.append(address)
            raise OSError(f"the test forbids network access ({address})")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)
    yield
    assert not reached, f"W&B offline reached out to {reached}"


@pytest.mark.integration  # W&B offline: its service process
def test_the_wandb_sink_logs_every_number_against_the_training_step(tmp_path, offline_wandb):
    from loomrl.metrics.wandb import WandbSink
    from loomrl.run_folder import WANDB_RUN_ID

    # no metrics.wandb.mode: W&B's own choice, WANDB_MODE=offline here
    sink = WandbSink(WandbConfig(tags=["unit"]), tmp_path, "unit-run", {"trainer": {"lr": 0.1}})
    log_all(sink)
    sink.close()
    run = wandb_run(tmp_path)
    assert run["ids"] == [(tmp_path / WANDB_RUN_ID).read_text().strip()]
    assert run["config"]["trainer"] == {"lr": 0.1} and run["tags"] == ["unit"] and run["name"] == "unit-run"
    # every record with a number is a row; the rollback's (a reason only) is not, nor is NaN a value
    assert run["rows"] == [{"eval/success": 0.25, "eval/n": 4, "step": 0},
                           {"train/loss": 0.5, "train/groups": 2, "step": 1},
                           {"train/loss": 0.25, "train/groups": 2, "step": 2},
                           {"train/loss": 0.125, "train/groups": 2, "step": 2},
                           {"eval/success": 0.75, "eval/n": 4, "step": 2}]


def test_wandb_online_without_a_login_stops_the_run_before_it_starts_and_says_offline_works(tmp_path, offline_wandb):
    with pytest.raises(SinkError, match=r"^metrics.wandb: wandb.init failed: .*No API key.* metrics.wandb.mode=offline"):
        open_metrics(tmp_path, MetricsConfig(wandb=WandbConfig(mode="online")))
    assert not (tmp_path / "wandb_run_id").exists()


@pytest.mark.integration
def test_a_tiny_training_run_leaves_an_offline_wandb_run_holding_its_metrics(tmp_path, offline_wandb):
    from loomrl.run_folder import WANDB_RUN_ID
    from loomrl.runtime.run import train

    overrides = [f"output_dir={tmp_path}", "progress=false", "runtime.mode=sync", "trainer.total_steps=2",
                 "checkpoint_every=1", "metrics.wandb.mode=offline", "metrics.wandb.project=loomrl-tests",
                 "metrics.wandb.tags=[tiny]"]
    cfg = load_checked(RECIPE, overrides)
    train(cfg)
    run = wandb_run(cfg.run_dir)
    assert run["ids"] == [(cfg.run_dir / WANDB_RUN_ID).read_text().strip()]
    assert run["config"]["trainer"]["total_steps"] == 2 and run["config"]["runtime"]["mode"] == "sync"
    assert run["tags"] == ["tiny"] and run["name"] == cfg.name
    # W&B holds what metrics.jsonl holds: every number of every record, train and eval, at its training step
    expected = []
    for record in read_metrics(cfg.run_dir, superseded=True):
        numbers = {(k if "/" in k else f"{record['kind']}/{k}"): v for k, v in record.items()
                   if k not in ("kind", "step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)
                   and math.isfinite(v)}
        if numbers:
            expected.append({**numbers, "step": record["step"]})
    assert run["rows"] == expected
    assert [(r["step"], "train/loss" in r, "eval/success" in r) for r in run["rows"]] == [
        (0, False, True), (1, True, False), (2, True, False), (2, False, True)]

    # resumed: the same W&B run id goes on, in a second offline-run folder (`wandb sync` uploads both, in order)
    more = load_checked(RECIPE, [*overrides, "trainer.total_steps=3"])
    train(more, resume=True)
    resumed = wandb_run(cfg.run_dir)
    assert resumed["ids"] == run["ids"] * 2
    assert [r["step"] for r in resumed["rows"] if "train/loss" in r] == [1, 2, 3]
