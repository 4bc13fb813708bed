"""User configuration: one pydantic model per section, YAML recipes, dotted CLI overrides.

A module per section (model, engine, env, agent, reward, buffer, trainer, runtime, eval, data, metrics, judge), the
whole recipe with every rule across sections (run.py RunConfig), and the loader (load.py): `load_config(path,
overrides)` returns a validated RunConfig or raises ConfigError whose message is one line per problem, naming the
dotted field, what was wrong and what to do. Each field is documented by the docstring under it; docs/configuration.md
is generated from them (scripts/config_reference.py). What only this machine or the run's environment can check is
runtime/checks.py's. The package imports nothing of loomrl outside it: every component imports it, never the other way.
"""

from loomrl.config.agent import AgentConfig, ContextConfig
from loomrl.config.base import ConfigError, Device, Section
from loomrl.config.buffer import BatchFilter, BufferConfig
from loomrl.config.data import DataConfig
from loomrl.config.engine import (
    VLLM_ARGS_SET_BY_LOOMRL,
    VLLM_MISSING,
    EngineConfig,
    SGLangConfig,
    SpeculationConfig,
    VLLMConfig,
)
from loomrl.config.env import EnvConfig
from loomrl.config.eval import EvalConfig
from loomrl.config.judge import JudgeConfig
from loomrl.config.load import ALIASES, RETIRED, _all_fields, build_config, load_config, parse_overrides, save_resolved
from loomrl.config.metrics import MetricsConfig
from loomrl.config.model import ModelConfig, SamplingConfig, TinyModelConfig
from loomrl.config.pools import EngineSetup, RolloutPoolConfig, TrainPoolConfig, WeightRoute
from loomrl.config.reward import RewardConfig, RewardTermConfig, TermConfig
from loomrl.config.run import RunConfig
from loomrl.config.runtime import ActorSpec, Placement, RayConfig, RuntimeConfig
from loomrl.config.terms import PROCESS_TERMS, Gate
from loomrl.config.trainer import (
    OWN_NORM,
    AdvantageKind,
    AdvantageNorm,
    Aggregation,
    CreditKind,
    ISLevel,
    ISVariant,
    KLKind,
    LossConfig,
    LossKind,
    TrainerConfig,
)

__all__ = [
    "ALIASES", "OWN_NORM", "PROCESS_TERMS", "RETIRED", "VLLM_ARGS_SET_BY_LOOMRL", "VLLM_MISSING", "ActorSpec",
    "AdvantageKind", "AdvantageNorm", "AgentConfig", "Aggregation", "BatchFilter", "BufferConfig", "ConfigError",
    "ContextConfig", "CreditKind", "DataConfig", "Device", "EngineConfig", "EngineSetup", "EnvConfig", "EvalConfig",
    "Gate", "ISLevel", "ISVariant", "JudgeConfig", "KLKind", "LossConfig", "LossKind", "MetricsConfig", "ModelConfig",
    "Placement", "RayConfig", "RewardConfig", "RewardTermConfig", "RolloutPoolConfig", "RunConfig", "RuntimeConfig",
    "SGLangConfig", "SamplingConfig", "Section", "SpeculationConfig", "TermConfig", "TinyModelConfig",
    "TrainPoolConfig", "TrainerConfig", "VLLMConfig", "WeightRoute", "_all_fields", "build_config", "load_config",
    "parse_overrides", "save_resolved",
]
