"""What the clients of an inference server (vLLM's, SGLang's) send with every request so that the server samples
from softmax(logits / T) as the trainer scores it."""

from __future__ import annotations

# Sent with every request by the clients of a server (vLLM's, SGLang's), whose unset fields take the model's
# generation_config or the server's preferred sampling params (Qwen's repetition_penalty 1.05, a min_p): those reshape
# the distribution sampled from, which the trainer, scoring softmax(logits / T), does not model. Names as both servers
# (and vLLM's SamplingParams) spell them; each value is the one that changes nothing.
NEUTRAL_PENALTIES: dict[str, float] = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                                       "min_p": 0.0}
