"""Peak memory of one training step as the step's tokens grow: the LM head dense (full [tokens, vocab]
logits kept for the backward) or chunked (loomrl/trainer/head.py), activation checkpointing off or on.

Each arm runs in a fresh process: load the model, take one warm-up step on a small batch (optimizer
state), then one step over `tokens` sampled tokens (one sample per 512 tokens, one micro-batch) while a
thread samples the heap in use (glibc mallinfo2) every millisecond; the step's memory is its peak above
the heap in use when it starts (gradients included: they are freed between steps). The dense arm swaps the package's chunked head for the full-logits one (the reference the
chunked head is tested against), everything else is the package's trainer.

Analytic model, float32, N tokens, vocabulary V, hidden H, L layers, intermediate I, block 128 rows:
- head, dense: logits and their log-softmax kept for the backward, plus the logits' gradient while it
  runs: about 3 x 4 N V bytes; chunked: about 3 x 4 x 128 x V, whatever N is.
- activations, no checkpointing: about 4 N L (8 H + 3 I) bytes (the projections' inputs and outputs,
  the MLP's three I-wide tensors); with checkpointing: 4 N L H (each layer's input) plus one layer's.
Not modelled: the gradients (4 x parameters, allocated by the backward) and autograd's other temporaries; read the
trend with tokens and the difference between arms.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, report  # noqa: E402

ROWS = 128


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


class HeapPeak:
    """Peak of the bytes malloc has handed out and not taken back (glibc mallinfo2: small blocks in use
    plus mmapped large ones), sampled every millisecond on a thread. Unlike the resident set, memory the
    allocator keeps after a free does not count, so one step's peak can be read after another's."""

    def __init__(self) -> None:
        self._mallinfo2 = ctypes.CDLL(None).mallinfo2
        self._mallinfo2.restype = _Mallinfo2
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def now(self) -> int:
        m = self._mallinfo2()
        return m.uordblks + m.hblkhd

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> HeapPeak:
        self.peak = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _arm(head: str, checkpointing: bool, tokens: int, model_kind: str) -> dict:
    """Inside the child process: one warm-up step, then the measured one."""
    import random

    import torch

    from loomrl.config import TrainerConfig
    from loomrl.trainer import head as head_module
    from loomrl.trainer import trainer as trainer_module
    from loomrl.types import TrainingSample

    torch.manual_seed(0)
    if head == "dense":
        def dense(model, hidden, targets, temperatures, *, rows=None):
            w = model.get_output_embeddings().weight
            h = hidden if rows is None else hidden[rows]
            t = temperatures if rows is None else temperatures[rows]
            z = (h @ w.t()).float() / torch.where(t > 0, t, torch.ones_like(t))[:, None]
            return torch.log_softmax(z, dim=-1).gather(1, targets[:, None]).squeeze(1)

        head_module.head_logprobs = trainer_module.head_logprobs = dense
    model = _model(model_kind)
    vocab = model.config.vocab_size
    rng = random.Random(0)

    def samples(total: int) -> list[TrainingSample]:
        out = []
        for k in range(max(1, total // 512)):
            n = min(512, total)
            ids = [rng.randrange(vocab) for _ in range(n + 1)]
            mask = [0] + [1] * n
            out.append(TrainingSample(trajectory_id=f"s{k}", group_id="g", token_ids=ids, loss_mask=mask,
                                      behaviour_logprobs=[-10.0 * m for m in mask], versions=[0] * len(ids),
                                      advantages=[(1.0 if k % 2 else -1.0) * m for m in mask]))
        return out

    cfg = TrainerConfig(lr=1e-6, micro_batch_size=64, activation_checkpointing=checkpointing)
    trainer = trainer_module.Trainer(model, cfg)
    trainer.train_step(samples(256))  # warm-up: optimizer state, allocator pools
    batch = samples(tokens)
    heap = HeapPeak()
    with heap:
        base = heap.now()
        stats = trainer.train_step(batch)
    return {"head": head, "checkpointing": checkpointing, "tokens": stats.loss_tokens,
            "step_mb": round((heap.peak - base) / 2**20, 1), "seconds": round(stats.seconds, 2)}


def _model(kind: str):
    """smollm2 (the real weights), tiny (random, SmolLM2's 49k vocabulary), or tiny152k: a tiny random model
    with Qwen2.5's 151,936-token vocabulary, where the head is nearly all of the memory."""
    from loomrl.config import ModelConfig
    from loomrl.model.loader import build_tiny_model, load_model

    if kind == "tiny152k":
        return build_tiny_model(ModelConfig(kind="tiny"), 151936, 0)
    return load_model(ModelConfig(kind=kind))[0]


def analytic_mb(cfg, tokens: int, head: str, checkpointing: bool) -> float:
    n, v, h, layers, inter = tokens, cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    head_bytes = 3 * 4 * (n if head == "dense" else min(n, ROWS)) * v
    act = 4 * n * layers * h + 4 * n * (8 * h + 3 * inter) if checkpointing else 4 * n * layers * (8 * h + 3 * inter)
    return round((head_bytes + act) / 2**20, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny", "tiny152k"])
    ap.add_argument("--tokens", default="512,1024,2048", help="comma-separated sampled tokens per step")
    ap.add_argument("--quick", action="store_true", help="the same path at the smallest size: a smoke run in seconds")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.model, args.tokens = "tiny", "64"
    if args.child:
        print(json.dumps(_arm(**json.loads(args.child), model_kind=args.model)), flush=True)
        return
    cfg = _model(args.model).config
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for head in ("dense", "chunked"):
            for checkpointing in (False, True):
                spec = json.dumps({"head": head, "checkpointing": checkpointing, "tokens": tokens})
                out = subprocess.run([sys.executable, __file__, "--model", args.model, "--child", spec],
                                     capture_output=True, text=True, check=True)
                row = json.loads(out.stdout.strip().splitlines()[-1])
                row["analytic_mb"] = analytic_mb(cfg, row["tokens"], head, checkpointing)
                rows.append(row)
    details = [f"{r['tokens']:6d} tokens  head {r['head']:7s}  checkpointing {str(r['checkpointing']):5s}  "
               f"step +{r['step_mb']:8.1f} MB  (analytic {r['analytic_mb']:8.1f} MB)  {r['seconds']:6.2f} s"
               for r in rows]
    report({"name": "trainer_memory", "machine": machine(),
            "model": f"{args.model}: vocabulary {cfg.vocab_size}, hidden {cfg.hidden_size}, "
                     f"{cfg.num_hidden_layers} layers, float32 on CPU",
            "measure": "peak heap in use during one training step above its start (mallinfo2 sampled each ms)",
            "details": details, "arms": rows}, args.json)


if __name__ == "__main__":
    main()
