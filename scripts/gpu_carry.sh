#!/usr/bin/env bash
# Wheels for scripts/gpu_smoke.py on a GPU machine that has torch, transformers and pyyaml but neither pydantic nor a
# network: the real Trainer imports loomrl.config, which needs pydantic. Downloads, into .gpu_wheels/ (git-ignored,
# about 7 MB; the device tool carries at most 64 MiB), what loomrl.trainer's import closure needs beyond those:
# pydantic, pydantic-core (binary: one wheel per CPython 3.10, 3.11, 3.12, manylinux x86_64), annotated-types,
# typing-inspection and typing-extensions (pydantic needs a newer one than torch may have brought). gpu_smoke.py
# unpacks the ones that match its interpreter into a temp dir and puts it first on sys.path.
#
#   scripts/gpu_carry.sh            # then, on the device: python scripts/gpu_smoke.py (carry .gpu_wheels)
#
# The closure was found by importing loomrl.trainer.{trainer,fsdp,forward,head,distributed}, loomrl.config and
# loomrl.weights.transports and listing the new top-level modules that torch and transformers do not bring:
# annotated_types, pydantic, pydantic_core, typing_inspection, typing_extensions, yaml (pyyaml: on the device).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu_wheels
pip=${PIP:-pip}
python=${PYTHON:-python}
# the version this checkout is tested with (pyproject asks for pydantic>=2.6)
pydantic=$("$python" -c "import pydantic; print(pydantic.VERSION)" 2>/dev/null || echo 2.14.4)
rm -rf "$out"
mkdir -p "$out"
for py in 3.10 3.11 3.12; do
  "$pip" download --quiet --only-binary=:all: --implementation cp --python-version "$py" \
    --platform manylinux2014_x86_64 --dest "$out" "pydantic==$pydantic"
done
ls -l "$out"
du -sh "$out"
