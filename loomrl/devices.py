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
runs on in this process is refused unless engine.sleep_while_training asks for colocation (runtime/checks.py
check_shared_gpu).
A sync run (runtime.mode=sync, local backend) trains the engine's own model object, so there the model is the
trainer's: float32 on trainer.device (check_run_devices refuses a config asking otherwise). Those two checks read a
whole recipe, so they live where a run is assembled (runtime/checks.py); this module reads single fields.

What this module is not: a loader (model/loader.py) or anything about several devices per process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loomrl.config import ConfigError

if TYPE_CHECKING:
    import torch

    from loomrl.config import TrainerConfig


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
