"""Recipes and overrides to a RunConfig: YAML, dotted overrides, retired and foreign field names, one-line errors."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from loomrl.config.base import ConfigError
from loomrl.config.run import RunConfig
from loomrl.config.trainer import LossKind


class _Loader(yaml.SafeLoader):
    """YAML 1.2's booleans: only true/false. PyYAML follows YAML 1.1, where on/off/yes/no are booleans too, so
    `tree_merge: on` arrived as True and was refused; a bool field still takes "on" or "yes" (pydantic's coercion)."""


_Loader.yaml_implicit_resolvers = {k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
                                   for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{key}' is a value, not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ["trainer.lr=1e-6", "runtime.mode=async"] into a nested dict (values parsed as YAML)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override '{item}': expected KEY=VALUE, e.g. trainer.lr=1e-6")
        if not key.strip():
            raise ConfigError(f"override '{item}': empty key; expected KEY=VALUE")
        _set_dotted(tree, key.strip(), _load_yaml(raw) if raw.strip() else "")
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _known_fields(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the section at `loc` (to suggest a fix for a misspelt key)."""
    current: Any = model
    for part in loc[:-1]:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        # an optional section (data, reward.judge): `X | None`, whose fields are X's
        current = next((a for a in get_args(field.annotation) if isinstance(a, type) and issubclass(a, BaseModel)),
                       field.annotation)
    return list(getattr(current, "model_fields", {}))


# Fields and values that existed once: a recipe still using one is told what replaced it.
_MOVED = {
    **{f"ray.{k}": f"runtime.{k} (the driver retries on every backend)" for k in ("max_group_attempts", "retry_backoff_s")},
    "ray.max_trainer_restarts": "runtime.max_trainer_restarts (one setting for every backend)",
    **{f"env.{k}": f"env.args.{k} (env.name=calculator's own settings)"
       for k in ("heldout_families", "crash_rate", "hang_rate", "step_latency_s", "step_latency_sigma", "few_shot")},
    **{f"reward.{k}": f"env.args.{k} (env.name=calculator's own reward settings)" for k in ("correct", "format_weight")},
    **{f"env.{name}": "env.args (an environment's own settings live there: env.args.<field>, e.g. env.args.few_shot)"
       for name in ("calculator", "gym")},
    "trainer.clip_eps": "trainer.loss.clip_low",
    **{f"trainer.{k}": f"trainer.loss.{k}"
       for k in ("clip_high", "is_level", "is_variant", "is_cap", "kl", "kl_coef", "aggregation", "norm_constant")},
    **{f"ray.{old.format(pool)}": f"ray.{pool}.{new}" for pool in ("rollout", "reward", "env")
       for old, new in (("num_{}_workers", "count"), ("{}_num_cpus", "num_cpus"), ("{}_resources", "resources"),
                        ("max_{}_restarts", "max_restarts"))},
    **{f"ray.trainer_{k}": f"ray.trainer.{k}" for k in ("num_cpus", "resources")},
}
RETIRED = {
    **{old: f"moved: use {new}" for old, new in _MOVED.items()},
    "engine.batch_wait_ms": "was an option of the torch engine, which is retired: remove it",
    "engine.kind=torch": "the torch engine is retired: use engine.kind=builtin (the default)",
    "trainer.loss": f"is a section now: use trainer.loss.kind=<{'|'.join(get_args(LossKind))}>",
}


def _all_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted field of `model`, sections and the fields inside them."""
    out = []
    for name, field in model.model_fields.items():
        out.append(prefix + name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out += _all_fields(field.annotation, f"{prefix}{name}.")
    return out


# What other frameworks call loomrl's fields (Hugging Face TrainingArguments and generate, TRL's GRPOConfig,
# verl, OpenRLHF, vLLM's engine arguments): a recipe ported from one is told loomrl's name, which spelling
# alone does not find (learning_rate is closer to lr_min_ratio than to lr). Keyed by the last part of the name,
# wherever it is written; tests/test_config.py checks that every target exists.
ALIASES = {
    **dict.fromkeys(("learning_rate", "actor_learning_rate"), "trainer.lr"),
    **dict.fromkeys(("max_grad_norm", "grad_norm", "clip_grad", "gradient_clipping"), "trainer.grad_clip"),
    **dict.fromkeys(("max_steps", "num_steps", "total_training_steps", "train_steps"), "trainer.total_steps"),
    **dict.fromkeys(("num_generations", "n_samples_per_prompt", "rollout_n"), "trainer.group_size"),
    **dict.fromkeys(("per_device_train_batch_size", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu",
                     "micro_train_batch_size", "train_micro_batch_size_per_gpu"), "trainer.micro_batch_size"),
    **dict.fromkeys(("gradient_checkpointing", "enable_gradient_checkpointing"), "trainer.activation_checkpointing"),
    **dict.fromkeys(("lr_scheduler_type", "lr_scheduler", "warmup_style"), "trainer.lr_schedule"),
    "min_lr_ratio": "trainer.lr_min_ratio",
    **dict.fromkeys(("lr_warmup_steps", "num_warmup_steps"), "trainer.warmup_steps"),
    **dict.fromkeys(("adam_beta1", "adam_beta2"), "trainer.betas"),
    **dict.fromkeys(("bf16", "mixed_precision"), "trainer.precision"),
    **dict.fromkeys(("adv_estimator", "advantage_estimator"), "trainer.advantage"),
    **dict.fromkeys(("norm_adv_by_std_in_grpo", "scale_rewards"), "trainer.advantage_norm"),
    **dict.fromkeys(("beta", "kl_loss_coef", "init_kl_coef"), "trainer.loss.kl_coef"),
    **dict.fromkeys(("kl_loss_type", "kl_estimator"), "trainer.loss.kl"),
    **dict.fromkeys(("epsilon", "clip_ratio", "eps_clip", "clip_ratio_low", "cliprange"), "trainer.loss.clip_low"),
    **dict.fromkeys(("epsilon_high", "clip_ratio_high"), "trainer.loss.clip_high"),
    "loss_agg_mode": "trainer.loss.aggregation",
    **dict.fromkeys(("max_new_tokens", "max_completion_length", "response_length", "generate_max_len"),
                    "sampling.max_tokens"),
    **dict.fromkeys(("model_name_or_path", "model_path", "pretrain"), "model.path"),
    **dict.fromkeys(("save_steps", "save_freq", "save_interval"), "checkpoint_every"),
    "max_num_seqs": "engine.max_batch_size",
    "enable_prefix_caching": "engine.prefix_cache",
    **dict.fromkeys(("project_name", "experiment_name", "run_name"), "name"),
}


def _initials(name: str) -> str:
    return "".join(word[0] for word in name.split("_") if word)


def _did_you_mean(loc: tuple[Any, ...]) -> list[str]:
    """Fields an unknown key at `loc` may have meant, named as the user would write them (a field of the same
    section by its own name, another by its dotted one): another framework's name for one, an abbreviation
    (learning_rate -> lr, mbs -> micro_batch_size), the same name in another section, then a near spelling."""
    key, section = str(loc[-1]), ".".join(str(p) for p in loc[:-1])
    known = _known_fields(RunConfig, loc)

    def named(dotted: str) -> str:
        inside = dotted.removeprefix(f"{section}.") if section else dotted
        return inside if inside in known else dotted

    if key in ALIASES:
        return [named(ALIASES[key])]
    abbreviated = [f for f in known if len(key) > 1 and (_initials(key) == f or _initials(f) == key)]
    if abbreviated:
        return abbreviated
    dotted = ".".join(str(p) for p in loc)
    elsewhere = [f for f in _all_fields(RunConfig) if f.rsplit(".", 1)[-1] == key and f != dotted]
    if elsewhere:
        return elsewhere
    return difflib.get_close_matches(key, known, n=1)


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        dotted = ".".join(str(p) for p in loc)
        retired = RETIRED.get(dotted) or RETIRED.get(f"{dotted}={e.get('input')}")
        if retired:
            lines.append(f"config error: '{dotted}' {retired}")
        elif e["type"] == "value_error":  # a validator's own message names the field(s) and the fix
            where = f"'{dotted}': " if dotted else ""  # a rule across sections has no one field
            lines.append(f"config error: {where}{e['msg'].removeprefix('Value error, ')}")
        elif e["type"] == "extra_forbidden":
            close = _did_you_mean(loc)
            hint = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close
                    else f"known fields: {', '.join(_known_fields(RunConfig, loc))}")
            lines.append(f"config error: unknown field '{dotted}'; {hint}")
        else:
            got = e.get("input")
            lines.append(f"config error: '{dotted}': {e['msg']} (got {got!r}); fix it in the recipe or override {dotted}=...")
    return "\n".join(lines)


def build_config(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML recipe (or start from defaults when path is None) and apply dotted overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config error: recipe file '{path}' does not exist; pass a YAML file such as examples/calculator_smollm2.yaml")
        try:
            loaded = _load_yaml(path.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"config error: '{path}' is not valid YAML: {err}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config error: '{path}' must hold a mapping of sections (model:, trainer:, ...)")
        data = loaded or {}
    data = _merge(data, parse_overrides(overrides or []))
    config = build_config(data)
    if path is not None and config.data is not None:
        # data files are named relative to the recipe's folder, like agent files; absolute from here on (Ray actors,
        # the saved config)
        base = Path(path).resolve().parent
        d = config.data
        for name in ("path", "heldout_path"):
            value = getattr(d, name)
            if value is not None:
                items = [value] if isinstance(value, str) else value
                items = [str(v if Path(v).is_absolute() else base / v) for v in items]
                setattr(d, name, items[0] if isinstance(value, str) else items)
    if path is not None and config.agent.files:
        # agent files are named relative to the recipe's folder; keep them absolute from here on
        base = Path(path).resolve().parent
        config.agent.files = [str(f if Path(f).is_absolute() else base / f) for f in config.agent.files]
    return config


def save_resolved(config: RunConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
