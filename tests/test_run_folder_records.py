"""The run folder's records read and write the bytes run folders already hold (loomrl/run_folder.py): a ledger line is
`{"step", "trained", "skipped", "stale"}` in that order, a line with fields missing (an older viewer-tolerated one)
reads with them empty, and the checkpoint layout is RUN/checkpoints/step_NNNNNN/{model/, optimizer.pt, state.pt}."""

from __future__ import annotations

import json

from loomrl.run_folder import CheckpointFolder, LedgerEntry, RunFolder, append_line, read_ledger


def test_a_ledger_line_is_written_and_read_as_before(tmp_path):
    folder = RunFolder(tmp_path)
    append_line(folder.ledger, LedgerEntry(step=1, trained=["a"], skipped={"zero_variance": ["b"]}, stale=["c"]))
    old = json.dumps({"step": 1, "trained": ["a"], "skipped": {"zero_variance": ["b"]}, "stale": ["c"]}) + "\n"
    assert (tmp_path / "ledger.jsonl").read_text() == old
    with folder.ledger.open("a") as f:
        f.write(json.dumps({"step": 2, "trained": ["d"]}) + "\n")
    assert read_ledger(tmp_path) == [LedgerEntry(step=1, trained=["a"], skipped={"zero_variance": ["b"]}, stale=["c"]),
                                     LedgerEntry(step=2, trained=["d"], skipped={}, stale=[])]


def test_the_checkpoint_layout_is_the_one_saved_runs_have(tmp_path):
    folder = RunFolder(tmp_path)
    ckpt = folder.checkpoint(10)
    assert ckpt.path == tmp_path / "checkpoints" / "step_000010" and ckpt.step == 10
    assert (ckpt.model, ckpt.optimizer, ckpt.state) == (ckpt.path / "model", ckpt.path / "optimizer.pt",
                                                        ckpt.path / "state.pt")
    for step in (2, 10, 9):
        folder.checkpoint(step).path.mkdir(parents=True)
    folder.checkpoint_in_progress(11).path.mkdir()  # being written: not a saved one
    assert [c.step for c in folder.saved_checkpoints()] == [2, 9, 10]
    assert CheckpointFolder(tmp_path / "elsewhere" / "step_000003").step == 3
    assert folder.evaluation("after", 3) == tmp_path / "evaluations" / "after-step3"
    assert folder.store_names() == ["trajectories"]
