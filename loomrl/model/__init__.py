"""Model loading (HF folders, GGUF, tiny random models), chat rendering to tokens, tool-call parsing."""

from loomrl.model.chat import ChatRenderer
from loomrl.model.loader import ModelLoadError, load_model, load_tokenizer
from loomrl.model.tools import ToolCall, parse_tool_calls

__all__ = ["ChatRenderer", "ModelLoadError", "ToolCall", "load_model", "load_tokenizer", "parse_tool_calls"]
