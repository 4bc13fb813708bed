"""What keeps a run from being reproduced exactly: the reasons, read from its config, that a rerun with the same config
and seed may sample other tokens or train other weights (summary.json `not_reproducible`; docs/reproducibility.md).

A sync run on the built-in engine, with keyed seeds (seeds.py), a white-box agent and no LLM judge, is by design a
function of its config and seed on one machine: its tasks come in the data order, each episode's environment and each
turn's sampling draw from streams named by what they are for, and the engine's kernels give a request the same logits
whatever shares its step (the engine logs a warning where its kernels do not: engine/builtin/runner.py
batch_invariant). The tests (tests/runtime/test_reproducible.py) rerun such runs and compare trajectories, losses and
weights bit for bit. Anything else is listed here with why.

What it is not: a check of the machine (other CPUs, other thread counts, other torch builds round differently), or of
what only the run can see: a sequence preempted and recomputed under K/V pressure, a prompt prefilled in chunks that
the step's budget cut elsewhere, or a prefix evicted from the cache and recomputed gets other bits
(docs/reproducibility.md); a model folder (model.kind hf, gguf) that is an MoE is not told apart here.
"""

from __future__ import annotations

from loomrl.config import RunConfig
from loomrl.devices import resolve_device

MOE_ARCHS = ("qwen3_moe", "mixtral", "olmoe")

def not_reproducible(cfg: RunConfig) -> list[str]:
    """Why a rerun of `cfg` may differ, one reason per entry; empty where the design makes it exact."""
    reasons = []
    if cfg.runtime.mode != "sync":
        reasons.append("async mode: which weight version samples a turn depends on timing")
    if cfg.engine.kind != "builtin":
        reasons.append(f"engine.kind={cfg.engine.kind}: its kernels' logits depend on what shares a batch")
    if not cfg.sampling.keyed(cfg.engine.kind):
        reasons.append("sampling.keyed_seeds=false: the engine draws in arrival order")
    if cfg.agent.kind == "blackbox":
        reasons.append("black-box agent: its program's requests are not seeded")
    if cfg.reward.judge is not None:
        reasons.append("reward.judge: an outside model scores")
    if cfg.trainer.world_size > 1 and cfg.runtime.backend == "ray":
        reasons.append("trainer ranks on Ray: not checked bit for bit")
    if cfg.model.kind == "tiny" and cfg.model.tiny.arch in MOE_ARCHS:
        reasons.append(f"a mixture of experts ({cfg.model.tiny.arch}): the engine groups tokens by expert, by batch")
    devices = {resolve_device(cfg.model.device, "model.device").type, resolve_device(cfg.trainer.device,
                                                                                     "trainer.device").type}
    if devices != {"cpu"}:
        reasons.append("a GPU: its kernels (cuBLAS picks them by batch size) and the trainer's ops are not checked "
                       "bit for bit")
    return reasons
