"""The chunked LM head + logprob (loomrl/trainer/head.py) against the dense one: time of forward +
backward, and the bytes autograd keeps between them, side by side in one run.

Arms, on the same random hidden rows, head weight and targets (per-row temperature 0.7):
- dense: log_softmax(hidden @ W.T / T).gather(target), autograd keeping the [N, V] float32 logits
  (and their softmax) for the backward;
- chunked: chunked_logprobs, which keeps N log-sum-exps and recomputes each block's logits in the
  backward.

Analytic bound of the time ratio chunked / dense: the head's matmuls dominate; dense runs three
([N,H]x[H,V] forward, then the hidden's and the weight's gradients), chunked four (the forward's
recomputed in the backward), so 4/3. Efficiency = bound / measured (1 = no cost beyond the recompute).
Memory: the dense arm keeps >= 4 x N x V bytes of logits; the chunked arm O(N) beyond its inputs.
Default shapes: SmolLM2-135M's head (hidden 576, vocabulary 49,152).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUICK_NOTE, bound_tolerance, divide, efficiency, machine, median, report  # noqa: E402

from loomrl.trainer.head import chunked_logprobs  # noqa: E402


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for the backward of fn() (the inputs counted once)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1500, help="hidden rows (targets)")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the same path at the smallest size: a smoke run in seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.vocab, args.repeats = 256, 8192, 1
    torch.manual_seed(0)
    n, h, v = args.rows, args.hidden, args.vocab
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (torch.randn(v, h) * 0.02).requires_grad_()
    targets = torch.randint(0, v, (n,))
    temps = torch.full((n,), 0.7)
    def dense():
        logits = (hidden @ weight.t()).float() / temps[:, None]
        return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)

    arms = {"dense": dense,
            "chunked": lambda: chunked_logprobs(hidden, weight, targets, temps, chunk=args.chunk)}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.repeats + 1):  # the first round warms up, untimed; arms interleaved
        for name, arm in arms.items():
            hidden.grad = weight.grad = None
            t0 = time.perf_counter()
            arm().sum().backward()
            times[name].append(time.perf_counter() - t0)
    dense_s, chunked_s = median(times["dense"][1:]), median(times["chunked"][1:])
    ratio, bound = divide(chunked_s, dense_s, "chunked seconds / dense seconds"), 4 / 3
    # here the bound is the least cost ratio, so the check runs on the speed-up dense / chunked against 3 / 4
    eff = efficiency(1 / ratio, 1 / bound, "chunked_head", bound_tolerance(args.quick))
    mem = {name: saved_bytes(arm) for name, arm in arms.items()}
    report({
        "name": "chunked_head", "machine": machine(),
        "workload": f"{n} rows x vocabulary {v} (hidden {h}), float32, forward + backward, chunk {args.chunk}",
        "dense_s": round(dense_s, 3), "chunked_s": round(chunked_s, 3), "ratio": round(ratio, 3),
        "bound": round(bound, 3), "efficiency": round(eff, 3),
        "saved_for_backward_mb": {k: round(b / 2**20, 1) for k, b in mem.items()},
        "logits_mb": round(4 * n * v / 2**20, 1),
        **({"details": [QUICK_NOTE]} if args.quick else {}),
    }, args.json)


if __name__ == "__main__":
    main()
