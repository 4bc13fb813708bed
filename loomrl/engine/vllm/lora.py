"""LoRA adapters on vLLM (trainer.lora with publish=adapter): the engine arguments that enable them, the adapter
folders a version is served from, which adapter each request carries, and the adapter's fingerprint as vLLM's worker
holds it (worker.py loomrl_adapter_fingerprint).

Each version's adapter is its own vLLM adapter: named weights/adapter.py adapter_name(version), with the int id
`lora_id(version)` in process (vLLM keys adapters by it: vllm/lora/request.py:8 LoRARequest; a server numbers the
adapters it loads itself), loaded from a PEFT folder written by the engine. A request carries the adapter of the
version it was admitted under, so its tokens are that version's; an adapter is removed (from vLLM and from disk) once
a newer version serves and no request uses it, since vLLM reloads an adapter a running request names from its folder
when it was evicted.

What it is not: the engines (engine/vllm/engine.py drives LoopAdapters, which calls AsyncLLM.add_lora / remove_lora;
engine/vllm/http.py the server's /v1/load_lora_adapter) or the reading inside vLLM's worker (worker.py); vLLM is
imported only where LoopAdapters makes a LoRARequest, on the in-process engine's loop.
"""

from __future__ import annotations

import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loomrl.config import ConfigError
from loomrl.engine.adapter_folder import write_version
from loomrl.engine.base import EngineFault
from loomrl.weights.adapter import AdapterMeta
from loomrl.weights.fingerprint import Fingerprint, TensorSum

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py:26 MaxLoRARanks (0.32)
# adapters vLLM runs in one batch: the version serving and the one before it, whose requests may still be running
MAX_LORAS = 2
# adapters its worker keeps loaded (vLLM's default: max_loras): during a switch three are live (the one before, the one
# serving, the one being added), and with 2 vLLM would evict one and reload it from its folder while its requests drain
MAX_CPU_LORAS = 3
LORA_OFF = ("update_adapter: this vLLM engine was started without LoRA (enable_lora): a run with trainer.lora and "
            "publish=adapter starts it with it; or set trainer.lora.publish=merged")


def lora_args(rank: int, targets: list[str] | None = None) -> dict[str, Any]:
    """AsyncEngineArgs that let vLLM serve adapters of rank `rank` on the modules `targets` (trainer.lora.target_modules;
    None: every module vLLM supports, MoE experts included, each with buffers for max_loras adapters): max_lora_rank
    is the smallest rank vLLM accepts that holds it."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ConfigError(f"trainer.lora.rank={rank}: vLLM 0.32 serves adapters up to rank {VLLM_LORA_RANKS[-1]}; "
                          "lower it or set trainer.lora.publish=merged")
    args: dict[str, Any] = {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": MAX_LORAS,
                            "max_cpu_loras": MAX_CPU_LORAS}
    if targets:
        args["lora_target_modules"] = list(targets)
    return args


def lora_id(version: int) -> int:
    """vLLM's int id for version `version`'s adapter (ids start at 1: vllm/lora/request.py:38)."""
    return version + 1


@dataclass(slots=True, frozen=True, kw_only=True)
class ServedAdapter:
    """One version's adapter as vLLM loads it: its name, int id, PEFT folder and scale (alpha / rank)."""

    version: int
    name: str
    lora_id: int
    folder: Path
    scale: float


class AdapterFolders:
    """The adapters an engine has loaded, by version, and the requests using each (counted on the engine's loop)."""

    def __init__(self, root: Path):
        self.root = root
        self.served: dict[int, ServedAdapter] = {}
        self.users: dict[int, int] = {}

    def write(self, weights: dict[str, torch.Tensor], adapter: AdapterMeta, version: int) -> ServedAdapter:
        """Version `version`'s adapter folder, written from its tensors (engine/adapter_folder.py)."""
        folder = write_version(self.root, weights, adapter, version)
        return ServedAdapter(version=version, name=adapter.name, lora_id=lora_id(version), folder=folder,
                             scale=adapter.scale)

    def acquire(self, version: int) -> ServedAdapter | None:
        """The adapter a request admitted under `version` is served with (None: the base model), counted as in use
        until `release`."""
        served = self.served.get(version)
        if served is not None:
            self.users[version] = self.users.get(version, 0) + 1
        return served

    def release(self, served: ServedAdapter | None) -> None:
        if served is not None:
            self.users[served.version] -= 1

    def retired(self, newest: int) -> list[ServedAdapter]:
        """The adapters to remove once `newest` serves: older than the one before it, with no request using them."""
        before = [v for v in self.served if v < newest]
        keep = max(before, default=None)
        return [a for v, a in self.served.items() if v not in (newest, keep) and not self.users.get(v)]

    def forget(self, adapter: ServedAdapter) -> None:
        self.served.pop(adapter.version, None)
        self.users.pop(adapter.version, None)
        shutil.rmtree(adapter.folder, ignore_errors=True)


class LoopAdapters:
    """The in-process engine's adapters (engine/vllm/engine.py): the folders by version, the LoRARequest each version's
    requests carry, and their adding to and removal from the AsyncLLM, on the engine's loop (as acquire and release).
    `enabled`: vLLM was started with enable_lora (the run's lora_rank or the user's engine_args)."""

    def __init__(self, root: Path, *, enabled: bool):
        self.folders = AdapterFolders(root)
        self.enabled = enabled
        self._requests: dict[int, Any] = {}  # version -> the LoRARequest its requests carry

    def write(self, weights: dict[str, torch.Tensor], adapter: AdapterMeta, version: int) -> ServedAdapter:
        """Version `version`'s adapter folder (AdapterFolders.write); refused when vLLM serves no adapters."""
        if not self.enabled:
            raise EngineFault(LORA_OFF)
        return self.folders.write(weights, adapter, version)

    def acquire(self, version: int) -> tuple[ServedAdapter | None, Any]:
        """The adapter a request admitted under `version` is served with and its LoRARequest (None, None: the base
        model), in use until `release`."""
        served = self.folders.acquire(version)
        return served, None if served is None else self._requests[served.version]

    def release(self, served: ServedAdapter | None) -> None:
        self.folders.release(served)

    def serving(self, version: int) -> ServedAdapter | None:
        """The adapter requests admitted under `version` carry (None: the base model)."""
        return self.folders.served.get(version)

    async def add(self, llm: Any, served: ServedAdapter, load: Callable[..., Awaitable[None]], *,
                  drop: bool = False) -> None:
        """Load `served` into `llm` (AsyncLLM.add_lora, vllm/v1/engine/async_llm.py:1189) through `load` (control.py
        load_adapter), which then makes its version the one requests see; retire the adapters no request uses
        (AsyncLLM.remove_lora, async_llm.py:1193). `drop` (test-only): the version is tagged, vLLM never gets it."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(served.name, served.lora_id, str(served.folder))

        async def hand_over() -> None:
            if served.version in self._requests:  # the same version again: replace it
                await llm.remove_lora(served.lora_id)
            if not drop and not await llm.add_lora(request):
                raise EngineFault(f"vLLM did not add adapter {served.name} (id {served.lora_id}): it holds "
                                  f"{sorted(await llm.list_loras())}")
            self.folders.served[served.version] = served
            self._requests[served.version] = request  # before the version requests see is this one

        await load(hand_over, served.version)
        for old in self.folders.retired(served.version):
            self._requests.pop(old.version, None)
            await llm.remove_lora(old.lora_id)
            self.folders.forget(old)


def adapter_fingerprint(expected: Fingerprint, served: ServedAdapter | None, rpc: Callable[..., Any], *,
                        newest: bool = False) -> Fingerprint:
    """The fingerprint of the adapter the engine's requests carry now (`served`; None: none), read in vLLM's worker
    (`rpc`: worker.py loomrl_adapter_fingerprint) by the published names: the adapter of id served.lora_id, or with
    `newest` the one vLLM added last (a server numbers the adapters it loads itself). An adapter vLLM does not hold
    gives no sums, so every published tensor differs (check: WeightMismatch); lora_B tensors vLLM keeps scaled in a
    way that cannot be undone exactly are `unchecked`, with the reason."""
    if served is None:
        return Fingerprint()
    wanted = {n: [s.dtype, list(s.shape)] for n, s in expected.sums.items()}
    got = rpc("loomrl_adapter_fingerprint", None if newest else served.lora_id, wanted, served.scale)
    sums = {n: TensorSum(expected.sums[n].dtype, tuple(shape), a, b) for n, (shape, a, b) in got["sums"].items()}
    return Fingerprint(sums=sums, unchecked=got["unchecked"])
