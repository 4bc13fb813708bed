"""A real crash: SIGKILL the trainer process of an async run mid-run, then `loomrl train --resume`.
The ledgers of the two segments together account for every step once, train no trajectory twice,
and everything they consumed is in the trajectory store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ledger_checks import check_each_trajectory_once, check_run

from loomrl.run_folder import read_ledger

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "calculator_tiny.yaml"


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def _pid_named(pid: int, name: str) -> int | None:
    """The child of `pid` that named itself `name` (trainer_ranks.name_process: loomrl-trainer, loomrl-rankN)."""
    for child in _children(pid):
        try:
            if Path(f"/proc/{child}/comm").read_text().strip() == name:
                return child
        except OSError:
            continue
    return None


def _train_args(tmp_path, name: str, *overrides: str) -> tuple[list[str], dict[str, str]]:
    args = [sys.executable, "-m", "loomrl.cli", "train", str(RECIPE), f"output_dir={tmp_path}", f"name={name}",
            "progress=false", "reward.function=rewards_for_tests:parity_reward", "trainer.total_steps=8",
            "checkpoint_every=2", "runtime.mode=async", *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    return args, env


def _run_killing_the_trainer(args: list[str], env: dict[str, str], run_dir: Path,
                             victim: str = "loomrl-trainer") -> tuple[int, str]:
    """Start the run, SIGKILL its trainer process (or the process named `victim`) once the ledger is
    past the first checkpoint (step 3), let the run end; (exit code, stdout and stderr)."""
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and len(read_ledger(run_dir)) < 3:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        assert len(read_ledger(run_dir)) >= 3, "the run did not reach step 3 in time"
        target = _pid_named(proc.pid, victim)
        assert target is not None, f"no process named {victim}"
        os.kill(target, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out


def test_sigkill_of_the_trainer_then_resume_accounts_for_every_trajectory_once(tmp_path):
    """With in-run restarts off: the run stops, says so, and `--resume` continues it."""
    args, env = _train_args(tmp_path, "killed", "eval.n_tasks=0", "runtime.max_trainer_restarts=0")
    run_dir = tmp_path / "killed"
    code, out = _run_killing_the_trainer(args, env, run_dir)
    assert code != 0
    assert "trainer" in out and "--resume" in out, out[-2000:]  # says what died and what to do
    steps_before = [e.step for e in read_ledger(run_dir)]
    assert steps_before and steps_before[-1] < 8

    resumed = subprocess.run([*args, "--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["steps"] == 8
    # steps after the checkpoint were cut, then redone: each step once, each trajectory once
    _, consumed, stored = check_each_trajectory_once(run_dir, 8)
    assert len({stored[t]["position"] for t in consumed}) == len(consumed) // 4  # whole groups of 4
    from loomrl.metrics.logger import read_metrics

    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"] == list(range(1, 9))


def test_sigkill_of_the_trainer_is_survived_by_an_in_run_restart(tmp_path):
    """Default supervision: the run restarts the killed trainer from its latest checkpoint, abandons
    what was sampled after it, and completes by itself; every step once, every trajectory once."""
    args, env = _train_args(tmp_path, "restarted", "eval.n_tasks=4")
    run_dir = tmp_path / "restarted"
    code, out = _run_killing_the_trainer(args, env, run_dir)
    assert code == 0, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("{")]  # stderr is interleaved
    assert lines, out[-3000:]
    summary = json.loads(lines[-1])
    assert summary["steps"] == 8 and summary["trainer_restarts"] == 1
    assert summary["success_after"] is not None  # evaluated with the final weights after the restart
    assert "restarting it (1 of 5)" in out
    check_run(run_dir, summary, 8)  # launched = the sum of the fates, across the restart
    acc = summary["accounting"]  # what was sampled after the checkpoint was thrown away, never trained
    assert acc["discarded"].get("trainer_restart", 0) + acc["cancelled"] > 0
    _, consumed, stored = check_each_trajectory_once(run_dir, 8)
    assert len({stored[t]["position"] for t in consumed}) == len(consumed) // 4
    # metrics: the steps redone after the restart are logged again; read_metrics keeps the final ones
    from loomrl.metrics.logger import read_metrics

    everything = read_metrics(run_dir, superseded=True)
    assert [r["reason"] for r in everything if r["kind"] == "rollback"] == ["trainer_restart"]
    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"] == list(range(1, 9))


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_sigkill_of_a_follower_rank_restarts_the_whole_trainer(tmp_path, parallel):
    """trainer.world_size=2: the second data-parallel rank is killed; the run stops rank 0 too, restarts
    both from the latest checkpoint (fsdp: the optimizer state in parts) and completes; every step once,
    every trajectory once."""
    args, env = _train_args(tmp_path, "ranks", "eval.n_tasks=0", "trainer.world_size=2", f"trainer.parallel={parallel}")
    run_dir = tmp_path / "ranks"
    code, out = _run_killing_the_trainer(args, env, run_dir, victim="loomrl-rank1")
    assert code == 0, out[-3000:]
    summary = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert summary["steps"] == 8 and summary["trainer_restarts"] == 1
    assert "trainer rank 1 died from signal SIGKILL" in out, out[-3000:]  # says which rank died and how
    check_run(run_dir, summary, 8)


def test_a_trainer_that_dies_between_checkpoint_and_report_loses_no_metrics(tmp_path):
    """The window the SIGKILL test hits only by chance, made certain: right after the trainer process
    checkpoints step 2 (and before the driver reads its answer) the process is SIGKILLed, so that the
    driver never sees step 2's metrics. The restarted trainer starts at version 2 from that checkpoint
    and hands the step's metrics back with it: every train row is there once, and the run adds up.
    (The kill is injected by wrapping the real trainer's train_step; trainer, run and kill are real.)"""
    from ledger_checks import check_run

    from loomrl.config import load_config
    from loomrl.metrics.logger import read_metrics
    from loomrl.runtime.failures import TrainerLost
    from loomrl.runtime.local import HandleRoute, LocalRollouts, ProcessTrainer
    from loomrl.runtime.parts import Parts
    from loomrl.runtime.run import train

    class DiesAfterCheckpoint(ProcessTrainer):
        killed = False

        async def train_step(self):
            step = await super().train_step()
            if step is not None and not self.killed:
                ckpt = self.cfg.run_dir / "checkpoints" / "step_000002"
                if ckpt.is_dir():  # the step that wrote it: its answer is lost with the process
                    self.killed = True
                    os.kill(self._process().child.proc.pid, signal.SIGKILL)
                    raise TrainerLost("trainer process died from signal SIGKILL (injected after its checkpoint)")
            return step

    cfg = load_config(RECIPE, [f"output_dir={tmp_path}", "name=window", "progress=false", "eval.n_tasks=0",
                               "reward.function=rewards_for_tests:parity_reward", "trainer.total_steps=4",
                               "checkpoint_every=2", "runtime.mode=async"])
    trainer = DiesAfterCheckpoint(cfg)

    def parts(cfg, checkpoint):  # the real local parts, with the trainer that gets killed
        rollouts = LocalRollouts(cfg, checkpoint)
        return Parts(rollouts, trainer, HandleRoute(cfg, rollouts))

    summary = train(cfg, parts=parts)
    assert trainer.killed and summary["steps"] == 4 and summary["trainer_restarts"] == 1
    rows = [r for r in read_metrics(cfg.run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    recovered = [r for r in rows if r.get("runtime/metrics_from_checkpoint")]
    assert [r["step"] for r in recovered] == [2] and recovered[0]["groups"] == cfg.trainer.groups_per_step
    check_run(cfg.run_dir, summary, 4)
