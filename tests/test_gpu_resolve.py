"""scripts/gpu_resolve.py's checks on what they read (the resolution itself needs PyPI and runs in `make test-vllm`):
a route engine/sglang.py calls that SGLang's server does not declare, an SGLang whose torch is not the pairing assumed,
and pip's report read into versions. The SGLang wheel is stood in for by a zip holding one http_server.py."""

from __future__ import annotations

import importlib.util
import io
import sys
import zipfile
from pathlib import Path

import pytest

from loomrl.engine import sglang_contract
from loomrl.model.transformers_contract import checkpointing_method, internals

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_resolve():
    spec = importlib.util.spec_from_file_location("gpu_resolve", ROOT / "scripts" / "gpu_resolve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_resolve"] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_resolve"]


def _wheel(routes: list[str]) -> zipfile.ZipFile:
    server = "\n".join(f'@app.post("{r}")\nasync def f{i}(obj):\n    pass\n' for i, r in enumerate(routes))
    server += '\n@app.api_route("/generate", methods=["POST", "PUT"])\nasync def generate(obj):\n    pass\n'
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("sglang/srt/entrypoints/http_server.py", server)
    return zipfile.ZipFile(buf)


def test_every_route_the_sglang_adapter_calls_must_be_declared_by_the_server(gpu_resolve):
    ours = gpu_resolve.adapter_routes((ROOT / "loomrl/engine/sglang.py").read_text())
    assert {"/generate", "/begin_weight_update", "/end_weight_update", "/update_weights_from_distributed",
            "/server_info"} <= ours
    resolved = {"sglang": sglang_contract.DOCUMENTED, "torch": sglang_contract.SERVER_TORCH}
    assert gpu_resolve.check_sglang(resolved, _wheel(sorted(ours - {"/generate"}))) == []
    # a server before the weight-update sessions: the adapter's calls it lacks are each named
    older = gpu_resolve.check_sglang(resolved, _wheel(sorted(ours - {"/generate", "/begin_weight_update"})))
    assert older == [f"sglang {sglang_contract.DOCUMENTED}'s HTTP server has no route /begin_weight_update, which "
                     "engine/sglang.py calls"]


def test_an_sglang_outside_the_pin_or_on_another_torch_is_named(gpu_resolve):
    routes = sorted(gpu_resolve.adapter_routes((ROOT / "loomrl/engine/sglang.py").read_text()) - {"/generate"})
    found = gpu_resolve.check_sglang({"sglang": "0.6.0", "torch": "2.15.0"}, _wheel(routes))
    assert len(found) == 2 and "0.6.0, outside sglang" in found[0] and "runs torch 2.15.0" in found[1]


def test_pips_report_is_read_into_versions(gpu_resolve):
    report = {"install": [{"metadata": {"name": "Torch", "version": "2.13.0"}},
                          {"metadata": {"name": "nvidia_nccl_cu13", "version": "2.29.7"}}]}
    assert gpu_resolve.versions_of(report) == {"torch": "2.13.0", "nvidia-nccl-cu13": "2.29.7"}
    assert gpu_resolve.base("2.13.0+cpu") == "2.13.0"
    cmd = gpu_resolve.pip_command(["vllm>=0.32,<0.33"], Path("r.json"), Path("t"))
    assert "--dry-run" in cmd and "--only-binary=:all:" in cmd and "manylinux_2_28_x86_64" in cmd
    assert "PIP_FIND_LINKS" not in gpu_resolve.isolated_env()  # this machine's local wheel folders are set aside


def test_the_checkpointing_name_is_the_one_each_transformers_has():
    """transformers 5.19 (what vLLM 0.32's pin resolves to) has only gradient_checkpointing_enable; 5.23 added
    activation_checkpointing_enable (the wheels of 5.20, 5.22, 5.23, 5.24 were read)."""
    assert checkpointing_method("5.19.0") == ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs")
    assert checkpointing_method("5.22.2")[0] == "gradient_checkpointing_enable"
    assert checkpointing_method("5.23.0") == ("activation_checkpointing_enable", "activation_checkpointing_kwargs")
    assert internals("5.19.0")[0].target == "transformers.modeling_utils:PreTrainedModel.gradient_checkpointing_enable"


def test_the_installed_transformers_has_every_name_loomrl_calls():
    from loomrl.model.transformers_contract import problems

    assert problems() == []
