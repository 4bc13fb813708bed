"""References the engine tests compare against: transformers' own greedy `generate` and a full forward pass."""

from __future__ import annotations

import torch


def greedy_reference(model, tokenizer, prompt: list[int], max_tokens: int) -> list[int]:
    """Token ids transformers' greedy `generate` produces after `prompt`."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return out[0, len(prompt):].tolist()


def forward_logits(model, prompt: list[int], sampled: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Logits (divided by the temperature when > 0) that predicted each sampled token: [len(sampled), V]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + sampled])).logits[0, len(prompt) - 1 : -1]
    return logits / temperature if temperature > 0 else logits


def token_logprobs(logits: torch.Tensor, sampled: list[int]) -> torch.Tensor:
    """log softmax(logits) at each sampled token."""
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(sampled).unsqueeze(1)).squeeze(1)


def check_processed_logprobs(model, prompts: list[list[int]], results: list, temperature: float, top_p: float,
                             atol: float) -> int:
    """Assert that each result's logprobs are of softmax(logits / T) renormalised over the top-p set (vLLM's
    processed_logprobs), from a float32 forward of `model`; the number of tokens whose logprob top-p changed (> 0
    shows the comparison tells the truncated distribution from the untruncated one)."""
    from loomrl.engine.common import filter_logits

    truncated = 0
    for p, r in zip(prompts, results):
        logits = forward_logits(model, p, r.token_ids, temperature)
        rows = len(logits)
        kept = token_logprobs(filter_logits(logits, torch.zeros(rows, dtype=torch.long), torch.full((rows,), top_p)),
                              r.token_ids)
        assert torch.allclose(torch.tensor(r.logprobs), kept, atol=atol, rtol=0)
        truncated += int((kept - token_logprobs(logits, r.token_ids) > 1e-3).sum())
    return truncated
