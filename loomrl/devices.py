"""Where a run's tensors live and in which dtype: `model.device`, `trainer.device` and `model.dtype` resolved
against this machine, and a model placed accordingly.

Devices: "auto" (cuda when torch.cuda.is_available(), else cpu), "cpu", "cuda", "cuda:N"; "auto" and "cuda"
resolve to the current CUDA device's index, so that two names of one device compare equal. A device this
machine lacks is refused with one line naming the field and what to do (DeviceError, a ConfigError).

Dtypes (the design verl follows): the trainer's parameters, gradients and AdamW state are float32 ("masters") on
trainer.device, whatever model.dtype says; its forward and backward compute in trainer.precision (autocast,
trainer.py compute_context). `model.dtype` is the dtype the rollout engine's model is loaded and served in
("auto": float32 on the CPU, bfloat16 on CUDA); weights the trainer publishes are cast to it as the engine loads
them. `model.device` is the built-in engine's only: vLLM and SGLang hold their weights in their own processes, and
the processes that drive them a meta-device skeleton (model/loader.py load_engine_model). A trainer on the GPU vLLM
runs on in this process is refused unless engine.sleep_while_training asks for colocation (check_shared_gpu).
A sync run (runtime.mode=sync, local backend) trains the engine's own model object, so there the model is the
trainer's: float32 on trainer.device (check_run_devices refuses a config asking otherwise).

What this module is not: a loader (model/loader.py) or anything about several devices per process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loomrl.config import ConfigError

if TYPE_CHECKING:
    import torch

    from loomrl.config import RunConfig, TrainerConfig


class DeviceError(ConfigError):
    """A device this machine does not have, or a device/dtype combination a run cannot use."""


def resolve_device(name: str, field: str) -> torch.device:
    """The torch device `name` (a `field` value: auto, cpu, cuda, cuda:N) means on this machine."""
    import torch

    if name == "cpu":
        return torch.device("cpu")
    if name != "auto" and not name.startswith("cuda"):
        raise DeviceError(f"config error: '{field}': {name!r} is not a device; use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        if name == "auto":
            return torch.device("cpu")
        raise DeviceError(f"config error: '{field}': {name} is not available here (torch.cuda.is_available() is "
                          f"False: no GPU, or a CPU-only torch build); set {field}=cpu or {field}=auto")
    device = torch.device(name if name != "auto" else "cuda")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise DeviceError(f"config error: '{field}': {name} is not available here (this machine has {count} CUDA "
                          f"device(s), cuda:0 to cuda:{count - 1}); set {field}=cuda:0 or {field}=auto")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def trainer_device(cfg: TrainerConfig) -> torch.device:
    """trainer.device on this machine."""
    return resolve_device(cfg.device, "trainer.device")


DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the dtypes a config may name


def dtype_named(name: str) -> torch.dtype:
    """torch's dtype for one of DTYPE_NAMES (KeyError for any other name)."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """model.dtype on `device`: "auto" is bfloat16 on CUDA and float32 elsewhere."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return dtype_named(name)


def place(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Move `model` to `device` and cast its floating parameters (and persistent buffers) to `dtype`, in place.

    Non-persistent buffers keep their dtype, as transformers' `from_pretrained(dtype=)` leaves them: the rotary
    embedding's inverse frequencies stay float32 (rounded to bfloat16 they would put a position near 4,000 off by
    radians). Tied weights stay tied (one Parameter). A model already there is left untouched (no copy)."""
    import torch

    model.to(device)
    with torch.no_grad():
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None and p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)
            for name, b in module._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != dtype \
                        and name not in module._non_persistent_buffers_set:
                    module._buffers[name] = b.to(dtype)
    return model


def check_run_devices(cfg: RunConfig) -> None:
    """Refuse, at config time, devices this machine lacks, a trainer on vLLM's GPU without colocation, and a sync
    run whose engine model could not be the trainer's. Ray runs are checked where their actors load the model (the
    driver may have no GPU); their GPUs are Ray's to share out (loomrl/config/ checks ray.*.num_gpus)."""
    if cfg.runtime.backend != "local":
        return
    model = resolve_device(cfg.model.device, "model.device")
    trainer = trainer_device(cfg.trainer)
    if cfg.runtime.weight_transport == "cuda_ipc" and cfg.runtime.mode == "async" and trainer.type != "cuda":
        raise DeviceError(f"config error: 'runtime.weight_transport': cuda_ipc shares the trainer's GPU memory with "
                          f"the engine, but trainer.device is {trainer}; put the trainer on the engine's GPU "
                          "(trainer.device=cuda:N) or use runtime.weight_transport=shm")
    check_shared_gpu(cfg, trainer)
    if cfg.runtime.mode != "sync":
        return
    # Sync mode trains the engine's model object in place (runtime/local.py shares it; no weight copy between
    # steps), so it is the trainer's float32 master copy on trainer.device: an engine dtype or device of its own
    # would need a second copy of the weights, which is what async mode keeps.
    if cfg.model.dtype not in ("auto", "float32"):
        raise DeviceError(f"config error: 'model.dtype': a sync run (runtime.mode=sync) serves the trainer's own "
                          f"float32 model, so it cannot be {cfg.model.dtype}; set model.dtype=float32 (or auto), or "
                          f"use runtime.mode=async to serve a {cfg.model.dtype} copy")
    if model != trainer:
        raise DeviceError(f"config error: 'model.device': a sync run (runtime.mode=sync) shares one model between the "
                          f"engine and the trainer, so model.device ({model}) must equal trainer.device ({trainer}); "
                          "set them to the same device, or use runtime.mode=async")


def check_shared_gpu(cfg: RunConfig, trainer: torch.device) -> None:
    """Refuse a local run whose trainer would share a GPU with vLLM in this process without colocation
    (engine.sleep_while_training): vLLM takes engine.vllm.gpu_memory_utilization of each GPU it runs on (its workers
    on cuda:0 to cuda:tp-1 of the visible ones), where the trainer's ranks (cuda:i to cuda:i+world_size-1 from
    trainer.device's i) would then run out of memory, or vLLM would not start. Servers over HTTP (SGLang, vLLM with
    base_url) are not checked: their GPUs are their own flags', unknown here; the built-in engine is not either (it
    takes only what its model and engine.kv_budget_tokens need)."""
    import torch

    e = cfg.engine
    if e.kind != "vllm" or e.vllm.base_url or e.sleep_while_training or trainer.type != "cuda":
        return
    tp, ranks = e.vllm.tensor_parallel_size, cfg.trainer.world_size
    if trainer.index >= tp:  # ranks count up from trainer.device's index (trainer/ranks.py)
        return
    vllm = "cuda:0" if tp == 1 else f"cuda:0 to cuda:{tp - 1}"
    fix = "set engine.sleep_while_training=true (vLLM sleeps while the trainer steps)"
    if cfg.runtime.weight_transport != "cuda_ipc" and torch.cuda.device_count() >= tp + ranks:
        fix += f", or trainer.device=cuda:{tp} to give the trainer a GPU of its own"
    rank_gpus = f" and its ranks to cuda:{trainer.index + ranks - 1}" if ranks > 1 else ""
    raise DeviceError(f"config error: 'trainer.device': the trainer ({trainer}{rank_gpus}) would share a GPU with vLLM "
                      f"(engine.kind=vllm in this process, on {vllm}) without colocation; {fix}")
