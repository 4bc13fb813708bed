"""The transformers names loomrl calls, for the version installed: checked by `make test` in the vLLM environment,
whose transformers is the one a GPU user's `pip install 'loomrl[vllm]'` resolves to (scripts/gpu_resolve.py).

Why: `.venv` gets the newest transformers, while vLLM pins an older one (vLLM 0.32: transformers <5.20, so 5.19.0). A
call that exists only in the newer one passed every test and stopped every trainer rank of the GPU recipes; so the
names are listed here, per version where transformers renamed one, and looked up in the older one too.

What it is not: a check of behaviour (the trainer's tests, which `make test` also runs in the vLLM environment, do
that), or a list of the names reached through a model's own modules.
"""

from __future__ import annotations

from packaging.version import Version

from loomrl.contracts import Internal, missing

# transformers renamed gradient_checkpointing_enable to activation_checkpointing_enable in 5.23 (5.22's wheel lacks the
# new name; from 5.23 the old one is a deprecated alias that warns).
ACTIVATION_CHECKPOINTING_RENAMED = Version("5.23")


def checkpointing_method(version: str) -> tuple[str, str]:
    """The PreTrainedModel method that turns activation checkpointing on in transformers `version`, and the keyword
    its options go in."""
    if Version(version) >= ACTIVATION_CHECKPOINTING_RENAMED:
        return "activation_checkpointing_enable", "activation_checkpointing_kwargs"
    return "gradient_checkpointing_enable", "gradient_checkpointing_kwargs"


def internals(version: str) -> tuple[Internal, ...]:
    """Everything loomrl imports from transformers or calls by name, with the keywords it passes, in `version`."""
    method, keyword = checkpointing_method(version)
    return (
        Internal(f"transformers.modeling_utils:PreTrainedModel.{method}", (keyword,)),  # trainer/forward.py
        Internal("transformers:AutoModelForCausalLM.from_pretrained"),  # model/loader.py
        Internal("transformers:AutoModelForCausalLM.from_config"),
        Internal("transformers:AutoConfig.from_pretrained"),
        Internal("transformers:AutoTokenizer.from_pretrained"),
        Internal("transformers:PretrainedConfig"),
        Internal("transformers:Qwen2Config"),  # model/loader.py's tiny models
        Internal("transformers:Qwen3Config"),
        Internal("transformers:PreTrainedTokenizerBase.apply_chat_template",  # model/chat.py
                 ("tools", "tokenize", "add_generation_prompt")),
        Internal("transformers:AttentionInterface.register"),  # trainer/tree.py's tree attention
        Internal("transformers:AttentionInterface._global_mapping"),
        Internal("transformers.utils:get_json_schema"),  # env/tools.py
        Internal("transformers.utils.chat_template_utils:DocstringParsingException"),
        Internal("transformers.utils.chat_template_utils:TypeHintParsingException"),
    )


def problems() -> list[str]:
    """What the installed transformers lacks of `internals()`, a short phrase each (empty: nothing)."""
    import transformers

    return missing(internals(transformers.__version__))
