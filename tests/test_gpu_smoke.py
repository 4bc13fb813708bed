"""scripts/gpu_smoke.py, run as a GPU machine would run it but on the CPU at toy sizes (--cpu): pydantic and the rest of
loomrl.config's closure are hidden from this venv's site-packages (as on a GPU machine that has torch and transformers
only) and come from wheels in a folder, as scripts/gpu_carry.sh fills it. The wheels are made here from the installed
packages (no network in tests). Its GPU numbers come from a GPU (benchmarks/RESULTS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from importlib.metadata import distribution
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_smoke.py"
CARRIED = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection")  # gpu_carry.sh's, less typing_extensions

# Imported at start-up by the script and by its spawned receivers: the carried packages are found anywhere but in
# site-packages, so that only the script's unpacked wheels can provide them.
HIDE = f"""
import importlib.machinery, sys

HIDDEN = {set(CARRIED)!r}
SITE = [p for p in sys.path if "site-packages" in p]

class HideInstalled:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if path is not None or name not in HIDDEN:
            return None  # submodules: found in their package, wherever it came from
        spec = importlib.machinery.PathFinder.find_spec(name, [p for p in sys.path if p not in SITE])
        if spec is None:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by tests/test_gpu_smoke.py)", name=name)
        return spec

sys.meta_path.insert(0, HideInstalled)
"""


def _wheel_of(name: str, folder: Path) -> Path:
    """An installed distribution zipped back into a wheel named as pip names one (its WHEEL file's first tag)."""
    dist = distribution(name)
    tag = next(line.split(": ", 1)[1] for line in dist.read_text("WHEEL").splitlines() if line.startswith("Tag: "))
    wheel = folder / f"{name}-{dist.version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for f in dist.files:
            if not str(f).startswith("..") and "__pycache__" not in str(f):
                z.write(dist.locate_file(f), str(f))
    return wheel


def test_gpu_smoke_runs_every_part_with_carried_wheels(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    site.mkdir()
    for name in CARRIED:
        _wheel_of(name, wheels)
    (site / "sitecustomize.py").write_text(HIDE)
    hidden = subprocess.run([sys.executable, "-c", "import pydantic"], env={**os.environ, "PYTHONPATH": str(site)},
                            capture_output=True, text=True)
    assert "hidden by tests/test_gpu_smoke.py" in hidden.stderr  # the hiding works: the script must carry them
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("LOOMRL_SMOKE_CARRIED", None)
    out = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--scratch", str(tmp_path / "scratch"),
                          "--wheels", str(wheels)], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["device"] == "cpu"
    assert {w.split("-")[0] for w in result["carried_wheels"]} == set(CARRIED)
    for part in "abcdefgh":
        assert "error" not in result[part] and result[part]["ok"], (part, result[part])
    b, c, g, h = result["b"], result["c"], result["g"], result["h"]
    assert [s["padding_micro_batches"] for s in b["steps"]] == [1, 1] and b["steps"][0]["micro_batches"] >= 1, b
    assert c["max_abs_logprob"] < 1e-4 and "grad_max_rel_diff" not in c, c  # no FlexAttention backward on a CPU
    assert len(c["seconds"]) == len(c["unique_tokens"]) and c["recompiles"] >= 1, c  # shapes differ: counted
    assert g["equal"] and g["tensors"] > 0, g
    assert h["broadcast"]["v1"]["equal"] and h["broadcast"]["v2"]["equal"], h  # the receiver got both versions
    assert result["f"]["skipped"] == "CUDA IPC needs a GPU"
