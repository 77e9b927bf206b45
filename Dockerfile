# DAS image for the GPU nodes (rollout workers, history replicas, topic initialisation).
# Base: vLLM's CUDA image at the version verl 0.9.1 pins (vllm==0.24.0), so the proposer runs inside the same
# vLLM the trainer uses. The history replica and `das kafka init` need no GPU and use the same image.
FROM vllm/vllm-openai:v0.24.0

WORKDIR /opt/das
# Dependency pins first, so code edits do not invalidate the dependency layer.
COPY pyproject.toml README.md ./
COPY requirements/project.txt requirements/project.txt
COPY pipeline pipeline
COPY history_store history_store
COPY workers workers
COPY monitoring monitoring
# The [vllm] extra is already satisfied by the base image's vllm; the constraints pin our other dependencies
# to the versions CI tests (requirements/project.txt).
RUN python3 -m pip install --no-cache-dir -c requirements/project.txt ".[vllm]"

# The base image's entrypoint starts an OpenAI server; DAS services choose their command in docker-compose.yml.
ENTRYPOINT []
CMD ["das", "--help"]
# /metrics (monitoring.server); compose sets DAS_METRICS_HOST=0.0.0.0 and DAS_METRICS_PORT=9400.
EXPOSE 9400
