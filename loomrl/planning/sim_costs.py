"""The cluster simulation's cost model (planning/cluster_sim.py): seconds per unit of work on one GPU instance and its
K/V budget, every figure with its source (a datasheet, a measurement, or "assumed" with the reasoning), and the lines
that print them beside any simulated result.

What it is not: a measurement. Nothing here ran on a GPU; `loomrl plan` calibrates from a real run (measure.py).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

SIMULATED = "SIMULATED (not measured)"

# Each cost-model field's source: a citation, or "assumed" with the reasoning.
SOURCES = {
    "prefill_tokens_per_s": "derived: 989 TFLOP/s dense BF16 (NVIDIA H100 SXM datasheet) x 25% utilisation (assumed) / "
                            "16 GFLOP per token (2 x 8e9 parameters, Llama-3-8B)",
    "decode_base_s": "derived: 16 GB of BF16 weights read per step / 3.35 TB/s HBM3 (H100 SXM datasheet) = 4.8 ms, at "
                     "~75% of that roofline as measured for vLLM at batch 1 on an A100 (johnmusgrave.com, 'vLLM "
                     "throughput-latency sweep on NVIDIA A100': 75 tok/s, 77% of roofline) = 6.5 ms",
    "decode_per_seq_s": "derived: each running sequence reads its K/V every step: ~3k tokens x 128 KiB / 3.35 TB/s "
                        "= 0.12 ms, rounded up for attention overhead (assumed)",
    "kv_bytes_per_token": "Llama-3-8B: 2 (K,V) x 32 layers x 8 KV heads x head_dim 128 x 2 bytes (BF16) = 128 KiB",
    "transfer_bytes_per_s": "assumed: half of PCIe Gen5 x16's 64 GB/s per direction, or of a 400 Gb/s (50 GB/s) "
                            "InfiniBand NDR NIC (NVIDIA ConnectX-7), to a host-memory pool",
    "transfer_latency_s": "assumed: a fixed 1 ms per fetch (lookup, RDMA/DMA setup)",
    "gpu_memory_bytes": "NVIDIA H100 SXM datasheet: 80 GB HBM3",
    "memory_fraction": "vLLM's gpu_memory_utilization default (0.9) for a dedicated rollout GPU; a co-located (hybrid) "
                       "engine gets less beside the trainer (verl's example rollout configs use 0.5)",
    "weights_bytes": "Llama-3-8B: 8.0e9 parameters x 2 bytes (BF16)",
    "activation_bytes": "assumed: ~4 GB of activations, CUDA graphs and allocator slack",
    "kv_capacity_tokens": "derived: (gpu_memory_bytes x memory_fraction - weights_bytes - activation_bytes) / "
                          "kv_bytes_per_token, unless kv_budget_tokens sets it: each instance's K/V budget",
    "max_batch": "vLLM's default max_num_seqs (256)",
    "pool_tokens_per_instance": "assumed: 128 GiB of host memory per GPU for the pool / 128 KiB = 1M tokens",
    "tool_median_s": "assumed: median tool call of 2 s (code execution, search); no published distribution found",
    "tool_sigma": "assumed: lognormal sigma 1.0 (a long tail: p99 ~ 10x the median)",
}


@dataclass(slots=True, kw_only=True, frozen=True)
class CostModel:
    """Seconds per unit of work on one instance and its K/V budget (defaults: Llama-3-8B, BF16, one H100 SXM; sources
    in SOURCES)."""

    prefill_tokens_per_s: float = 15_000.0
    decode_base_s: float = 0.0065  # a decode step at batch size 0 (weights read once per step)
    decode_per_seq_s: float = 0.00015  # added per running sequence
    kv_bytes_per_token: int = 2 * 32 * 8 * 128 * 2
    transfer_bytes_per_s: float = 25e9
    transfer_latency_s: float = 0.001
    gpu_memory_bytes: float = 80e9
    memory_fraction: float = 0.9
    weights_bytes: float = 16e9
    activation_bytes: float = 4e9
    kv_budget_tokens: int = 0  # 0: derived from the memory figures (kv_capacity_tokens)
    max_batch: int = 256
    pool_tokens_per_instance: int = 1_000_000
    tool_median_s: float = 2.0  # 0: no tool wait
    tool_sigma: float = 1.0

    @property
    def kv_capacity_tokens(self) -> int:
        """Each instance's K/V budget in tokens: what its memory holds beside the weights (or kv_budget_tokens)."""
        if self.kv_budget_tokens:
            return self.kv_budget_tokens
        free = self.gpu_memory_bytes * self.memory_fraction - self.weights_bytes - self.activation_bytes
        if free < self.kv_bytes_per_token:
            raise ValueError(f"CostModel: no room for K/V: {self.gpu_memory_bytes:.3g} B x memory_fraction "
                             f"{self.memory_fraction} leaves {free:.3g} B beside the weights and activations")
        return int(free // self.kv_bytes_per_token)

    def decode_step_s(self, batch: int) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch

    def tool_s(self, rng: random.Random) -> float:
        return rng.lognormvariate(math.log(self.tool_median_s), self.tool_sigma) if self.tool_median_s > 0 else 0.0

    def fetch_s(self, tokens: int) -> float:
        return self.transfer_latency_s + tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s if tokens else 0.0


def cost_lines(cost: CostModel) -> list[str]:
    """Every figure of `cost`, with its source."""
    lines = [f"  {name} = {getattr(cost, name)}  ({SOURCES[name]})" for name in SOURCES]
    lines.append(f"  decode step = {cost.decode_base_s * 1e3:.1f} ms + {cost.decode_per_seq_s * 1e3:.2f} ms x batch "
                 f"({cost.decode_step_s(64) * 1e3:.1f} ms at batch 64)")
    return lines
