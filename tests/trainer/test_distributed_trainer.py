"""Data-parallel training (loomrl/train_pool/distributed.py) on real local ranks (spawned processes, gloo):
two ranks with an uneven split of samples take the same step as one process on the whole batch, and a
failing or silent rank ends the run with an error instead of a hang."""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_launch import in_sync, launch_local

from loomrl.config import ModelConfig, TrainerConfig
from loomrl.model.loader import build_tiny_model
from loomrl.train_pool.distributed import DataParallelTrainer, shard_samples
from loomrl.trainer.forward import token_logprobs
from loomrl.trainer.trainer import Trainer
from loomrl.types import TrainingSample

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

# (trainer options, idle tokens and sequences of the step) per case; micro-batches of 2 give the ranks
# different numbers of backward passes (2 and 3), the case DDP cannot take.
CASES = [
    ({}, (0, 0)),
    ({"aggregation": "seq_mean_token_mean"}, (10, 2)),
    ({"aggregation": "token_sum_norm", "kind": "decoupled_ppo"}, (0, 0)),
]
SPLIT = 3  # rank 0 trains on the first 3 samples, rank 1 on the other 5
STEPS = 2
LOPSIDED = {"aggregation": "seq_mean_token_mean"}


def _cfg(options: dict) -> TrainerConfig:
    # Adam divides by sqrt(v): a gradient component near 0 turns float32 rounding (~1e-7 of the
    # gradient) into a large relative change of its update; at lr=1e-4 that stays below 1e-7 of the
    # parameters, and the gradients are compared directly too.
    return TrainerConfig(lr=1e-4, micro_batch_size=2, loss=options)  # options: trainer.loss fields


def _model(vocab: int, eos: int) -> torch.nn.Module:
    return build_tiny_model(ModelConfig(kind="tiny"), vocab, eos)


def _samples(model: torch.nn.Module, vocab: int) -> list[TrainingSample]:
    """8 samples of different lengths; behaviour logprobs near the model's, so some ratios clip."""
    rng = random.Random(0)
    out = []
    for i, length in enumerate([9, 17, 6, 23, 12, 30, 8, 15]):
        ids = [rng.randrange(vocab) for _ in range(length)]
        n_prompt = 3 + i % 3
        mask = [0] * n_prompt + [1] * (length - n_prompt)
        adv = 1.0 if i % 2 else -1.0
        out.append(TrainingSample(trajectory_id=f"s{i}", group_id="g", token_ids=ids, loss_mask=mask,
                                  behaviour_logprobs=[0.0] * length, versions=[0] * length,
                                  advantages=[adv * m for m in mask]))
    for s, lp in zip(out, token_logprobs(model, out, with_grad=False)):
        pos = [t for t in range(1, len(s.token_ids)) if s.loss_mask[t]]
        for t, v in zip(pos, lp.tolist()):
            s.behaviour_logprobs[t] = v + rng.uniform(-0.3, 0.3)
    return out


def _trained(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The last step's gradient (summed over ranks, clipped): kept until the next step zeroes it."""
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _idle_share(idle: tuple[int, int], rank: int) -> tuple[int, int]:
    """The step's idle counts split unevenly between two ranks (they are summed back)."""
    tokens, seqs = idle
    return (tokens // 3, seqs // 2) if rank == 0 else (tokens - tokens // 3, seqs - seqs // 2)


def _rank_train(rank: int, world: int, vocab: int, eos: int, samples: list[TrainingSample]) -> dict:
    shard = samples[:SPLIT] if rank == 0 else samples[SPLIT:]
    out: dict = {"params": [], "grads": [], "in_sync": [], "losses": []}
    for options, idle in CASES:
        dp = DataParallelTrainer(Trainer(_model(vocab, eos), _cfg(options)))
        idle_tokens, idle_seqs = _idle_share(idle, rank)
        for _ in range(STEPS):
            stats = dp.train_step(copy.deepcopy(shard), idle_tokens=idle_tokens, idle_seqs=idle_seqs)
            out["losses"].append(stats.loss)
        out["params"].append(_trained(dp.trainer.model))
        out["grads"].append(_grads(dp.trainer.model))
        out["in_sync"].append(in_sync(dp))
    # Fewer samples than ranks: rank 1 gets none and still takes the step (seq_mean_token_mean: the
    # step's sequence count must come from rank 0 alone).
    dp = DataParallelTrainer(Trainer(_model(vocab, eos), _cfg(LOPSIDED)))
    dp.train_step(copy.deepcopy(samples) if rank == 0 else [])
    out["lopsided"] = _trained(dp.trainer.model)
    try:
        dp.train_step([])
        out["empty_raised"] = False
    except ValueError:
        out["empty_raised"] = True
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def test_two_ranks_equal_one_process_on_an_uneven_split(tokenizer):
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    torch.manual_seed(0)
    samples = _samples(_model(vocab, eos), vocab)
    ranks = launch_local(_rank_train, 2, (vocab, eos, samples), timeout_s=120, threads=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: another thread count sums in another order (~1e-6 apart)
    try:
        refs = []
        for options, idle in CASES:
            trainer = Trainer(_model(vocab, eos), _cfg(options))
            losses = [trainer.train_step(copy.deepcopy(samples), idle_tokens=idle[0], idle_seqs=idle[1]).loss
                      for _ in range(STEPS)]
            refs.append((losses, _trained(trainer.model), _grads(trainer.model)))
        lopsided = Trainer(_model(vocab, eos), _cfg(LOPSIDED))
        lopsided.train_step(copy.deepcopy(samples))
    finally:
        torch.set_num_threads(threads)
    for c, (options, _) in enumerate(CASES):
        losses, ref, ref_grads = refs[c]
        for r in ranks:
            assert r["in_sync"][c]
            for name, want in ref.items():
                assert _rel(r["params"][c][name], want) < 1e-6, (options, name)
                assert _rel(r["grads"][c][name], ref_grads[name]) < 1e-6, (options, name)
        # identical replicas, bit for bit
        assert all(torch.equal(ranks[0]["params"][c][n], ranks[1]["params"][c][n]) for n in ref)
        got = ranks[0]["losses"][c * STEPS : (c + 1) * STEPS]
        assert got == pytest.approx(losses, rel=1e-5, abs=1e-7)
    for r in ranks:
        for name, want in _trained(lopsided.model).items():
            assert _rel(r["lopsided"][name], want) < 1e-6, name
    assert ranks[0]["empty_raised"] and ranks[1]["empty_raised"]


def _rank_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.all_reduce(torch.ones(1))  # rank 0 would wait here for ever without the launcher


def test_a_failing_rank_is_an_error_not_a_hang():
    start = time.monotonic()
    with pytest.raises(Exception, match="rank 1 fails on purpose"):
        launch_local(_rank_fails, 2, timeout_s=60, threads=1)
    assert time.monotonic() - start < 30


def _rank_silent(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(60)  # alive but never joins the collective
    dist.all_reduce(torch.ones(1))


def test_a_silent_rank_times_out():
    start = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - gloo's timeout error (rank 0) or the launcher's TimeoutError
        launch_local(_rank_silent, 2, timeout_s=4, threads=1)
    assert time.monotonic() - start < 30


def test_shard_samples_balances_tokens():
    samples = [TrainingSample(trajectory_id=str(n), group_id="g", token_ids=[1] * n, loss_mask=[1] * n,
                              behaviour_logprobs=[0.0] * n, versions=[0] * n, advantages=[0.0] * n)
               for n in (30, 23, 17, 15, 12, 9, 8, 6)]
    shards = shard_samples(samples, 3)
    assert sorted(s.trajectory_id for sh in shards for s in sh) == sorted(s.trajectory_id for s in samples)
    loads = [sum(len(s.token_ids) for s in sh) for sh in shards]
    assert max(loads) - min(loads) <= 8
    assert [len(sh) for sh in shard_samples(samples[:2], 3)] == [1, 1, 0]  # a rank without samples


def test_shard_samples_keeps_groups_together_when_it_can():
    def sample(i: int, group: str, n: int) -> TrainingSample:
        return TrainingSample(trajectory_id=f"{group}{i}", group_id=group, token_ids=[1] * n, loss_mask=[1] * n,
                              behaviour_logprobs=[0.0] * n, versions=[0] * n, advantages=[0.0] * n)

    samples = [sample(i, g, n) for g, n in (("a", 10), ("b", 12), ("c", 9)) for i in range(4)]
    shards = shard_samples(samples, 2, keep_groups=True)
    assert all(len({s.group_id for s in sh}) >= 1 for sh in shards)
    for g in "abc":
        assert sum(any(s.group_id == g for s in sh) for sh in shards) == 1, g  # each group on one rank
    one_group = samples[:4]  # fewer groups than ranks: split per sample, so every rank trains
    assert [len(sh) for sh in shard_samples(one_group, 2, keep_groups=True)] == [2, 2]


def test_a_sync_run_with_two_ranks_takes_the_steps_of_one(tmp_path):
    """The runtime with trainer.world_size=2 (rank 0 in this process, rank 1 spawned): same rollouts
    (same seed, sync), so the same gradient each step within float rounding, and the same weights at
    the end. Every step also checks inside the run that rank 1's parameters equal rank 0's, bit for bit."""
    from safetensors.torch import load_file

    from loomrl.config import load_config
    from loomrl.metrics.logger import read_metrics
    from loomrl.runtime.run import train
    from loomrl.trainer.checkpoint import latest_checkpoint

    root = Path(__file__).resolve().parents[2]
    runs = {}
    for world in (1, 2):
        cfg = load_config(root / "examples" / "calculator_tiny.yaml",
                          [f"output_dir={tmp_path}", f"name=w{world}", "progress=false", "runtime.mode=sync",
                           "reward.function=rewards_for_tests:parity_reward", "trainer.total_steps=3",
                           "eval.n_tasks=0", f"trainer.world_size={world}",
                           # a calculator call that a loaded machine (CI beside other jobs) holds past the default
                           # 5 s ends as a tool error, and that run trains on other tokens: not what is compared
                           "env.tool_timeout_s=300"])
        assert train(cfg)["steps"] == 3
        norms = [m["train/grad_norm"] for m in read_metrics(cfg.run_dir) if "train/grad_norm" in m]
        weights = load_file(str(next((latest_checkpoint(cfg.run_dir) / "model").glob("*.safetensors"))))
        entropy = [m["train/entropy"] for m in read_metrics(cfg.run_dir) if "train/entropy" in m]
        records = [json.loads(x) for x in (cfg.run_dir / "train_records.jsonl").read_text().splitlines()]
        runs[world] = norms, weights, entropy, records
    (norms1, w1, ent1, rec1), (norms2, w2, ent2, rec2) = runs[1], runs[2]
    assert norms1 and norms2 == pytest.approx(norms1, rel=1e-4)
    assert ent1 and ent2 == pytest.approx(ent1, rel=1e-4)  # the step's mean over both ranks' tokens
    # rank 1's per-token gaps come back in its report: every trained context has them, as with one rank
    assert rec2 and all(g is not None for r in rec2 for g in r["gaps"])
    assert sorted(len(g) for r in rec2 for g in r["gaps"]) == sorted(len(g) for r in rec1 for g in r["gaps"])
    for name, want in w1.items():
        assert _rel(w2[name].float(), want.float()) < 1e-5, name


def test_rank0_stops_waiting_for_a_follower_that_dies_before_it_joins(tokenizer, tmp_path):
    """A follower that cannot start (here: its model path does not exist) makes rank 0's join fail
    within seconds, naming the rank, instead of waiting out the rendezvous timeout (300 s)."""
    from loomrl.config import RunConfig
    from loomrl.train_pool.ranks import LocalRankGroup, RankLost, join_watching, spawn_local_followers

    cfg = RunConfig.model_validate({"model": {"kind": "hf", "path": str(tmp_path / "no-such-model")},
                                    "trainer": {"world_size": 2}, "output_dir": str(tmp_path)})
    followers = spawn_local_followers(cfg.train_pool(), torch.device("cpu"), None, threads=1)
    ranks = LocalRankGroup(2, torch.device("cpu"), *followers.channels(), dead=followers.dead)
    start = time.monotonic()
    try:
        with pytest.raises(RankLost, match="trainer rank 1 exited with code 1 before it joined"):
            join_watching(ranks, followers)
    finally:
        followers.stop()
    assert time.monotonic() - start < 60


def test_rank0_loads_its_model_before_it_joins_the_ranks(tmp_path):
    """Every rank loads its model first, then meets the others (TrainerService.from_run joins after the load, as the
    followers do). Rank 0 used to join first: followers still loading a large model left it in the rendezvous, and
    it loaded its own only once they came. Here rank 0's model cannot load and no follower ever comes: it now fails at
    once with the loader's error; it used to wait in the rendezvous for the follower (300 s)."""
    import multiprocessing as mp

    from loomrl.config import RunConfig
    from loomrl.train_pool.distributed import free_port
    from loomrl.train_pool.process import Failed, _trainer_main
    from loomrl.train_pool.ranks import Child

    cfg = RunConfig.model_validate({"model": {"kind": "hf", "path": str(tmp_path / "no-such-model")},
                                    "trainer": {"world_size": 2}, "output_dir": str(tmp_path)})
    ctx = mp.get_context("spawn")
    inbox, outbox, follower_in, follower_out = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    child = Child("trainer process", "loomrl-trainer", _trainer_main, cfg.train_pool().model_dump_json(), {}, "", 1, inbox, outbox,
                  (([follower_in], [follower_out]), free_port()))
    try:
        msg = outbox.get(timeout=60)
    finally:
        child.proc.kill()
    assert isinstance(msg, Failed) and "no-such-model" in msg.error, msg
    assert "init_process_group" not in msg.error  # it never reached the rendezvous
