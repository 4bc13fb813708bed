"""scripts/gpu_smoke.py, run as a GPU machine would run it but on the CPU at toy sizes (--cpu), with pydantic made
unimportable: the script needs torch and transformers only. Its GPU numbers come from a GPU (benchmarks/RESULTS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_smoke.py"


def test_gpu_smoke_runs_every_part_without_the_config_layer(tmp_path):
    code = ("import runpy, sys; sys.modules['pydantic'] = None; "  # `import pydantic` raises ImportError
            f"sys.argv = ['gpu_smoke.py', '--cpu', '--scratch', {str(tmp_path)!r}]; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["device"] == "cpu"
    for part in "abcdef":
        assert "error" not in result[part], (part, result[part])
    a, b = result["a"], result["b"]
    assert a["ok"] and a["grads_finite"] and a["loss_rel_diff_checkpointing"] < 1e-2, a
    assert a["max_abs_dense_vs_tree"] < 0.05, a  # bf16 autocast on both paths
    assert b["dcp_equal"] and b["grad_norm_finite"] and b["step_s"] > 0, b
    assert result["d"]["finite"] and 0 < result["e"]["tokens_per_s"]
    assert result["f"]["skipped"] == "CUDA IPC needs a GPU"
    assert result["c"]["max_abs_logprob"] < 1e-4 and result["c"]["gradients"] == "not on the CPU"
