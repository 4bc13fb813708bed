"""Devices and dtypes (loomrl/devices.py): what a config may ask for on this machine, refused in one line naming the
field, and how a model is placed. This machine has no GPU; the tests that need one to exist fake torch's CUDA queries
(torch.cuda.is_available / device_count / current_device) and say so."""

from __future__ import annotations

import pytest
import torch

from loomrl.config import ConfigError, ModelConfig
from loomrl.devices import DeviceError, place, resolve_device, resolve_dtype
from loomrl.runtime.checks import load_checked


@pytest.fixture
def two_fake_gpus(monkeypatch):
    """A machine with cuda:0 and cuda:1, as torch's queries report it (nothing is put on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_defaults_on_the_cpu_are_float32_on_cpu():
    cfg = load_checked(None, [])
    assert (cfg.model.device, cfg.model.dtype, cfg.trainer.device) == ("auto", "auto", "auto")
    device = resolve_device(cfg.model.device, "model.device")
    assert device == torch.device("cpu") and resolve_dtype(cfg.model.dtype, device) == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("override", ["model.device=cuda", "trainer.device=cuda:1"])
def test_a_cuda_device_is_refused_where_there_is_none(override):
    field = override.split("=")[0]
    with pytest.raises(DeviceError) as err:
        load_checked(None, [override])
    msg = str(err.value)
    assert isinstance(err.value, ConfigError) and len(msg.splitlines()) == 1
    assert f"'{field}'" in msg and "not available here" in msg and f"set {field}=cpu or {field}=auto" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_ray_run_checks_devices_where_the_model_is_loaded():
    """The driver of a Ray run may have no GPU while its actors do: the config loads, and loading the model on a
    machine without CUDA refuses it with the same line."""
    cfg = load_checked(None, ["runtime.backend=ray", "model.device=cuda", "model.kind=tiny"])
    with pytest.raises(DeviceError, match="'model.device': cuda is not available here"):
        from loomrl.model.loader import load_model

        load_model(cfg.model)


def test_a_device_name_that_is_none_is_refused():
    for bad in ("gpu", "cuda:x", "mps"):
        with pytest.raises(ConfigError, match=r"'trainer.device': '.*' is not a device; use auto, cpu, cuda or cuda:N"):
            load_checked(None, [f"trainer.device={bad}"])


def test_resolution_with_gpus_and_a_missing_index(two_fake_gpus):
    assert resolve_device("auto", "model.device") == resolve_device("cuda", "model.device") == torch.device("cuda:0")
    assert resolve_device("cuda:1", "model.device") == torch.device("cuda:1")
    assert resolve_dtype("auto", torch.device("cuda:0")) == torch.bfloat16
    with pytest.raises(DeviceError, match=r"'trainer.device': cuda:2 is not available here \(this machine has 2 CUDA "
                                          r"device\(s\), cuda:0 to cuda:1\); set trainer.device=cuda:0"):
        resolve_device("cuda:2", "trainer.device")


def test_a_sync_run_refuses_an_engine_dtype_of_its_own():
    for dtype in ("bfloat16", "float16"):
        with pytest.raises(DeviceError) as err:
            load_checked(None, ["runtime.mode=sync", f"model.dtype={dtype}"])
        msg = str(err.value)
        assert len(msg.splitlines()) == 1 and "'model.dtype'" in msg and "set model.dtype=float32" in msg
    for ok in (["runtime.mode=sync", "model.dtype=float32"], ["runtime.mode=async", "model.dtype=bfloat16"],
               ["runtime.mode=sync", "runtime.backend=ray", "model.dtype=bfloat16"]):  # Ray: no shared model
        load_checked(None, ok)


def test_a_sync_run_refuses_two_devices(two_fake_gpus):
    with pytest.raises(DeviceError) as err:
        load_checked(None, ["runtime.mode=sync", "model.device=cuda:1", "trainer.device=auto"])
    msg = str(err.value)
    assert len(msg.splitlines()) == 1 and "'model.device'" in msg and "must equal trainer.device (cuda:0)" in msg
    load_checked(None, ["runtime.mode=sync", "model.device=cuda", "trainer.device=cuda:0"])  # one device, two names
    load_checked(None, ["runtime.mode=async", "model.device=cuda:1", "trainer.device=cuda:0"])


def test_place_casts_parameters_and_keeps_rotary_frequencies_and_ties(tiny_model):
    import copy

    model = copy.deepcopy(tiny_model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    place(model, torch.device("cpu"), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.equal(p, before[n].to(torch.bfloat16)) for n, p in model.named_parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # a non-persistent buffer: as from_pretrained
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    weight = model.lm_head.weight
    place(model, torch.device("cpu"), torch.bfloat16)
    assert model.lm_head.weight is weight and weight.dtype == torch.bfloat16  # already there: untouched
    place(model, torch.device("cpu"), torch.float32)
    assert all(torch.equal(p, before[n].to(torch.bfloat16).float()) for n, p in model.named_parameters())


def test_the_model_config_carries_device_and_dtype():
    cfg = ModelConfig(kind="tiny", device="cpu", dtype="bfloat16")
    assert resolve_dtype(cfg.dtype, resolve_device(cfg.device, "model.device")) == torch.bfloat16
    with pytest.raises(ValueError):
        ModelConfig(dtype="int8")


def test_cuda_ipc_weights_need_the_trainer_on_a_gpu_and_an_async_local_run(two_fake_gpus):
    """runtime.weight_transport=cuda_ipc maps the trainer's GPU memory in the engine's process: a CPU trainer, a sync
    run (one shared model) and a Ray run without colocated vLLM engine actors (weights through the object store or a
    broadcast; colocated, each trainer rank pushes to the vLLM engine on its GPU) are refused, naming the field."""
    with pytest.raises(DeviceError, match=r"'runtime.weight_transport': cuda_ipc .* trainer.device is cpu"):
        load_checked(None, ["runtime.mode=async", "runtime.weight_transport=cuda_ipc", "trainer.device=cpu"])
    with pytest.raises(ConfigError, match="runtime.weight_transport=cuda_ipc needs runtime.mode=async"):
        load_checked(None, ["runtime.mode=sync", "runtime.weight_transport=cuda_ipc"])
    with pytest.raises(ConfigError, match="runtime.weight_transport=cuda_ipc on Ray is for colocated engine actors"):
        load_checked(None, ["runtime.mode=async", "runtime.backend=ray", "runtime.weight_transport=cuda_ipc"])
    colocated = ["runtime.mode=async", "runtime.backend=ray", "runtime.weight_transport=cuda_ipc",
                 "engine.sleep_while_training=true", "ray.engine.count=1", "ray.engine.num_gpus=0.5",
                 "ray.trainer.num_gpus=0.5"]
    with pytest.raises(ConfigError, match="cuda_ipc on Ray needs engine.kind=vllm in process"):
        load_checked(None, colocated)  # the built-in engine: nothing maps a bucket
    assert load_checked(None, [*colocated, "engine.kind=vllm"]).runtime.weight_transport == "cuda_ipc"
    cfg = load_checked(None, ["runtime.mode=async", "runtime.weight_transport=cuda_ipc", "trainer.device=cuda:0",
                             "model.device=cuda:0"])
    assert cfg.runtime.weight_transport == "cuda_ipc"


def test_a_trainer_on_vllms_gpu_needs_colocation(two_fake_gpus, monkeypatch):
    """Locally vLLM in process runs on cuda:0 (to cuda:tp-1) and claims most of it, and trainer.device=auto is cuda:0
    too: without engine.sleep_while_training that config stops in one line naming the fields to change (a GPU of the
    trainer's own only where the machine has one). Asking for colocation, a trainer on another GPU, a vLLM server
    elsewhere (its GPUs are its own flags') and a CPU machine pass. No GPU here: torch's CUDA queries are faked."""
    from loomrl.config import build_config, parse_overrides
    from loomrl.runtime.checks import check_run_devices

    vllm = ["engine.kind=vllm", "runtime.mode=async"]
    with pytest.raises(DeviceError) as err:
        load_checked(None, vllm)
    msg = str(err.value)
    assert len(msg.splitlines()) == 1 and msg == (
        "config error: 'trainer.device': the trainer (cuda:0) would share a GPU with vLLM (engine.kind=vllm in this "
        "process, on cuda:0) without colocation; set engine.sleep_while_training=true (vLLM sleeps while the trainer "
        "steps), or trainer.device=cuda:1 to give the trainer a GPU of its own")
    # its ranks count up from trainer.device: cuda:1 and cuda:2 clear vLLM's two GPUs, but there is no cuda:2 here
    with pytest.raises(DeviceError, match=r"^config error: 'trainer.device': the trainer \(cuda:1 and its ranks to "
                                          r"cuda:2\) would share a GPU with vLLM \(.* on cuda:0 to cuda:1\) without "
                                          r"colocation; set engine.sleep_while_training=true \(vLLM sleeps while the "
                                          r"trainer steps\)$"):
        load_checked(None, [*vllm, "trainer.device=cuda:1", "trainer.world_size=2", "trainer.parallel=fsdp",
                           "engine.vllm.tensor_parallel_size=2"])
    with pytest.raises(DeviceError, match=r"without colocation; set engine.sleep_while_training=true \(vLLM sleeps "
                                          r"while the trainer steps\)$"):  # cuda_ipc: the trainer on vLLM's GPU
        load_checked(None, [*vllm, "runtime.weight_transport=cuda_ipc"])
    for fine in (["engine.sleep_while_training=true"], ["trainer.device=cuda:1"], ["trainer.device=cpu"],
                 ["engine.vllm.base_url=http://gpu-node:8000"]):
        check_run_devices(build_config(parse_overrides([*vllm, *fine])))  # (load_checked would ask for vLLM here)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine: trainer.device=auto is cpu
    check_run_devices(build_config(parse_overrides(vllm)))




def test_broadcast_weights_need_receivers_that_join_the_group_and_an_async_run():
    """runtime.weight_transport=broadcast: the engine's processes join the trainer's process group. Locally vLLM's
    workers or an SGLang server's do (the built-in engine and a vLLM server at engine.vllm.base_url are refused); on Ray
    the engine actors do, any engine kind, so engine actors are needed; sync runs are refused. Each names what to
    set."""
    async_ = ["runtime.mode=async", "runtime.weight_transport=broadcast"]
    with pytest.raises(ConfigError, match="broadcast on runtime.backend=local needs engine.kind=vllm or sglang"):
        load_checked(None, async_)
    with pytest.raises(ConfigError, match="broadcast needs runtime.mode=async"):
        load_checked(None, ["runtime.mode=sync", "runtime.weight_transport=broadcast"])
    with pytest.raises(ConfigError, match=r"broadcast on Ray needs engine actors \(ray.engine.count > 0\)"):
        load_checked(None, [*async_, "runtime.backend=ray"])
    with pytest.raises(ConfigError, match="broadcast needs vLLM in process"):
        load_checked(None, [*async_, "engine.kind=vllm", "engine.vllm.base_url=http://x:1"])
    cfg = load_checked(None, [*async_, "runtime.backend=ray", "ray.engine.count=2"])
    assert cfg.engine.kind == "builtin" and cfg.ray.engine.count == 2
    sglang = ["engine.kind=sglang", "engine.sglang.base_url=http://x:1"]
    assert load_checked(None, [*async_, *sglang]).runtime.weight_transport == "broadcast"
