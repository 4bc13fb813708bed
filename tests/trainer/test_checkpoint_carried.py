"""What a trainer's checkpoint carries, typed: the positions received (trainer_boundary.py PositionState), the
runtime's facts (Carried: the held-out evaluation before training) and the random generators' state
(trainer/checkpoint.py RngState). Each is saved in state.pt as the dict it always was, so that a checkpoint saved
before they were typed resumes with them; the first two cross to the trainer process and Ray actors by pickle."""

from __future__ import annotations

import json
import pickle
import random
from dataclasses import asdict

import numpy as np
import torch

from loomrl.config import load_config
from loomrl.train_pool.service import TrainerService
from loomrl.trainer.checkpoint import RngState, load_state
from loomrl.trainer_boundary import Carried, PositionSet, PositionState
from loomrl.types import EvalRecord, Score

BEFORE = EvalRecord(success=0.25, n=8, stderr=0.15, statuses={"completed": 8},
                    splits={"heldout": Score(success=0.5, n=4, stderr=0.25)})


def _service(tmp_path, tiny_model, tokenizer, resume_from=None) -> TrainerService:
    cfg = load_config(None, [f"output_dir={tmp_path}", "name=carried", "model.kind=tiny", "trainer.total_steps=10"])
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    return TrainerService(cfg.train_pool(), tiny_model, tokenizer, resume_from=resume_from, device=torch.device("cpu"))


def test_a_checkpoint_saved_before_its_state_was_typed_resumes_with_it(tmp_path, tiny_model, tokenizer):
    """state.pt as every checkpoint so far wrote it: "received" and "extra" as plain dicts."""
    service = _service(tmp_path, tiny_model, tokenizer)
    service.received = PositionSet(3, {5})
    ckpt = service.checkpoint()
    raw = load_state(ckpt)
    raw["received"] = {"watermark": 3, "above": [5]}
    raw["extra"] = {"eval_before": asdict(BEFORE)}  # the old form, written literally
    torch.save(raw, ckpt / "state.pt")
    resumed = _service(tmp_path, tiny_model, tokenizer, resume_from=ckpt)
    assert resumed.carried == Carried(eval_before=BEFORE)
    assert resumed.received.state() == PositionState(watermark=3, above=(5,))
    assert [p in resumed.received for p in range(7)] == [True, True, True, False, False, True, False]


def test_a_checkpoint_saves_them_as_the_json_it_always_had(tmp_path, tiny_model, tokenizer):
    service = _service(tmp_path, tiny_model, tokenizer)
    service.received = PositionSet(2, {7, 4})
    service.carried = Carried(eval_before=BEFORE)
    raw = load_state(service.checkpoint())
    assert raw["received"] == {"watermark": 2, "above": [4, 7]}
    assert raw["extra"] == {"eval_before": asdict(BEFORE)}
    json.dumps([raw["received"], raw["extra"]])  # plain values: no loomrl class is needed to read a checkpoint


def test_a_checkpoint_without_facts_carries_none_and_the_drivers_fill_in():
    """A checkpoint saved before any fact was carried (no "extra", or an empty one); from_run fills in the driver's
    facts where the checkpoint has none, and the checkpoint's win where it has them."""
    assert Carried.from_json(None) == Carried.from_json({}) == Carried()
    assert Carried().as_json() == {}
    other = EvalRecord(success=1.0, n=1, stderr=0.0, statuses={"completed": 1})
    assert Carried().filled_from(Carried(eval_before=BEFORE)).eval_before == BEFORE
    assert Carried(eval_before=other).filled_from(Carried(eval_before=BEFORE)).eval_before == other


def test_they_cross_process_boundaries_by_pickle():
    for value in (Carried(eval_before=BEFORE), Carried(), PositionSet(4, {6, 9}).state()):
        assert pickle.loads(pickle.dumps(value)) == value
    assert PositionSet.of(PositionSet(4, {6, 9}).state()).state() == PositionState(watermark=4, above=(6, 9))


def test_the_rng_state_is_saved_as_before_and_restores_every_generator(tmp_path, tiny_model, tokenizer):
    raw = load_state(_service(tmp_path, tiny_model, tokenizer).checkpoint())["rng"]
    assert set(raw) == {"python", "numpy", "torch"}  # and "cuda" where CUDA was initialized
    drawn = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    RngState.from_json(raw).restore()
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == drawn
