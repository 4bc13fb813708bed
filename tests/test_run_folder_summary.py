"""summary.json and the accounting of segments.jsonl, typed (loomrl/run_folder.py Summary, Fates): written as the
same JSON as before they were typed (the keys, in their order, the backend's section beside them), read back into
their types, and a summary or segment written by an older loomrl (fields missing) still reads."""

from __future__ import annotations

import json

from loomrl.run_folder import Fates, LedgerEntry, Segment, Summary, read_segments, read_summary, write_summary
from loomrl.runtime.summary import append_segment, finished_at, whole_run
from loomrl.types import EvalRecord, Score

ACC = {"launched": 8, "trained": 4, "skipped": {"zero_variance": 4}, "stale": 0, "discarded": {}, "unconsumed": 0,
       "failed": {}, "cancelled": 0, "violations": []}


def _segment(from_step: int, to_step: int, extra: dict) -> Segment:
    return Segment(from_step=from_step, to_step=to_step, ended="finished", wall_s=1.25, rollouts={},
                   trainer_restarts=1, untrained_steps=0, positions_failed={"3": "died"}, env_pool={"created": 2.0},
                   accounting=Fates.from_json(ACC), extra=extra)


def test_summary_json_is_written_as_before_and_read_back_typed(tmp_path):
    before = EvalRecord(success=0.25, n=4, stderr=0.2, statuses={"completed": 4},
                        splits={"heldout": Score(success=0.5, n=2, stderr=0.35)})
    segments = append_segment(tmp_path, _segment(0, 2, {"ray": {"restarts": 1}}))
    ledger = [LedgerEntry(step=1, trained=["a", "b"], skipped={"zero_variance": ["c"]}, stale=[])]
    summary = whole_run(tmp_path, segments, before, None, 2, ledger)
    write_summary(tmp_path, summary)
    # the keys and values whole_run wrote as a dict, in its order
    old = {"success_before": 0.25, "success_after": None, "n_heldout": 4, "stderr_before": 0.2, "stderr_after": None,
           "heldout_splits": {"heldout": {"n": 2, "success_before": 0.5, "stderr_before": 0.35, "success_after": None,
                                          "stderr_after": None}},
           "eval_ended": {"before": {"completed": 4}}, "steps": 2, "ended": "finished", "run_dir": str(tmp_path),
           "wall_s": 1.2, "rollouts": {},
           "ledger": {"steps": 1, "trained": 2, "skipped": {"zero_variance": 1}, "stale": 0},
           "accounting": ACC, "trainer_restarts": 1, "untrained_steps": 0, "positions_failed": {"3": "died"},
           "env_pool": {"created": 2.0},
           "segments": [{"from_step": 0, "to_step": 2, "ended": "finished", "wall_s": 1.25, "accounting": ACC}],
           "not_reproducible": [],  # added after the others (runtime/reproducibility.py)
           "ray": {"restarts": 1}}
    assert (tmp_path / "summary.json").read_text() == json.dumps(old, indent=2)
    assert read_summary(tmp_path) == summary
    assert summary.accounting.trained == 4 and summary.ledger.skipped == {"zero_variance": 1}
    assert summary.extra == {"ray": {"restarts": 1}} and read_summary(tmp_path / "none") is None


def test_a_summary_and_a_segment_from_an_older_loomrl_still_read(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 7, "success_after": 0.5}))  # before segments
    assert finished_at(tmp_path) == 7
    legacy = read_summary(tmp_path)
    assert legacy is not None and (legacy.steps, legacy.success_after, legacy.accounting) == (7, 0.5, Fates())
    line = {"from_step": 0, "to_step": 1, "ended": "finished", "wall_s": 1.0, "rollouts": {}, "trainer_restarts": 0,
            "untrained_steps": 0, "positions_failed": {}, "env_pool": {}, "accounting": {"launched": 3, "trained": 3},
            "extra": {}}
    (tmp_path / "segments.jsonl").write_text(json.dumps(line) + "\n")
    assert read_segments(tmp_path)[0].accounting == Fates(launched=3, trained=3)
    assert Summary.from_json({}) == Summary()
