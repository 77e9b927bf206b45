# DAS image for every DAS and Ray service of docker-compose.yml: verl's trainer and Ray nodes, history replicas,
# topic initialisation and the bench rollout workers.
# Base: verl's own vLLM 0.24 image, built from verl's docker/Dockerfile.stable.vllm: CUDA 13.0.2, torch 2.11.0
# (cu130), vLLM 0.24.0, flash-attn 2.8.3, Python 3.12, and verl's dependency closure with verl itself
# uninstalled. verl 0.9.1 pins vllm==0.24.0, so the trainer, its rollout servers and the DAS proposer run on the
# exact stack verl was released and tested against (vllm/vllm-openai lacks verl's training dependencies).
FROM verlai/verl:vllm024.dev2

WORKDIR /opt/das
# What the base ships becomes a hard constraint: torch, vLLM, flash-attn and their CUDA libraries are built
# against each other, and nothing we install may move one of them (pip fails instead). `pip list` rather than
# `pip freeze`: packages the base installed from URLs appear as plain name==version, which constraints accept.
RUN python3 -m pip list --format=freeze --exclude-editable > /opt/das/base-constraints.txt

# Dependencies before code, so an edit of our code reuses this layer: an empty package skeleton lets pip resolve
# and install pyproject.toml's dependencies (and verl 0.9.1 itself) without any of our source.
COPY pyproject.toml README.md ./
COPY requirements/project.txt requirements/project.txt
RUN mkdir pipeline history_store workers monitoring \
 && python3 -m pip install --no-cache-dir -c base-constraints.txt -c requirements/project.txt . verl==0.9.1 \
 && python3 -m pip uninstall -y das-rollout \
 && rmdir pipeline history_store workers monitoring

# Our code, then a consistency check of the whole environment: a conflict fails the build, not a training run.
COPY pipeline pipeline
COPY history_store history_store
COPY workers workers
COPY monitoring monitoring
COPY examples examples
COPY scripts/ray_head.sh scripts/ray_head.sh
RUN python3 -m pip install --no-cache-dir --no-deps . && python3 -m pip check

# The base image's entrypoint starts an OpenAI server; every service chooses its command in docker-compose.yml.
ENTRYPOINT []
CMD ["das", "--help"]
# /metrics (monitoring.server); compose sets DAS_METRICS_HOST=0.0.0.0 and DAS_METRICS_PORT=9400.
EXPOSE 9400
