"""docker-compose.cpu.yml merged over docker-compose.yml is a valid project that runs on one machine without GPUs,
and each local image's build file gives the containers what the compose files expect of them (ports, paths,
users, health checks), checked without a Docker engine.

The merge follows Compose's rules for what the files use (YAML anchors and merge keys, `extends`, `!reset`,
`!override`, mappings merged key by key, volumes and configs by container path, command lists replaced); where
the Compose plugin is installed (scripts/install_docker.sh), a test also compares it with `docker compose config`.
`make compose-check` runs the project for real (scripts/compose_check.py)."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from monitoring_support import COMPOSE_SCHEMA, REPO
from test_compose import SECRETS, command_of, environment, interpolate, mounts, option, published_ports

CPU_FILE = REPO / "docker-compose.cpu.yml"
MAIN_FILE = REPO / "docker-compose.yml"
# Host ports the test suite's own brokers use on this machine (scripts/kafka.sh): no container may take them.
TEST_PORTS = {*range(19092, 19100), *range(29092, 29098), *range(29192, 29195), *range(39092, 39100)}
NODES = {"ray-worker": "history", "ray-worker-1": "history-1"}
METRICS_PORT = "9400"


class Reset:
    """`!reset`: the key is removed from the merged service."""


class Override:
    """`!override value`: the value replaces the base's instead of merging with it."""

    def __init__(self, value: Any) -> None:
        self.value = value


class ComposeLoader(yaml.SafeLoader):
    pass


def _reset(loader: yaml.SafeLoader, node: yaml.Node) -> Reset:
    return Reset()


def _override(loader: yaml.SafeLoader, node: yaml.Node) -> Override:
    if isinstance(node, yaml.MappingNode):
        return Override(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Override(loader.construct_sequence(node, deep=True))
    return Override(loader.construct_scalar(node))


ComposeLoader.add_constructor("!reset", _reset)
ComposeLoader.add_constructor("!override", _override)


def load(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(), Loader=ComposeLoader)  # noqa: S506 - SafeLoader with two tags


def _volume_target(entry: Any) -> str:
    return entry["target"] if isinstance(entry, dict) else str(entry).split(":")[1]


# Lists Compose replaces; volumes and configs merge by their container path; the other lists append.
REPLACED = {"command", "entrypoint", "test"}
BY_TARGET = {"volumes": _volume_target, "configs": lambda entry: entry["target"]}


def merge(base: Any, over: Any, key: str = "") -> Any:
    if isinstance(over, Override):
        return copy.deepcopy(over.value)
    if isinstance(base, dict) and isinstance(over, dict):
        out = copy.deepcopy(base)
        for k, v in over.items():
            if isinstance(v, Reset):
                out.pop(k, None)
            elif k in out:
                out[k] = merge(out[k], v, k)
            else:
                out[k] = strip(v)
        return out
    if isinstance(base, list) and isinstance(over, list):
        if key in REPLACED:
            return copy.deepcopy(over)
        if key in BY_TARGET:
            target = BY_TARGET[key]
            kept = [entry for entry in base if target(entry) not in {target(e) for e in over}]
            return kept + copy.deepcopy(over)
        return base + [entry for entry in over if entry not in base]
    return strip(over)


def strip(value: Any) -> Any:
    """A value of the override file that has no base: its tags say nothing any more."""
    if isinstance(value, Override):
        return copy.deepcopy(value.value)
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if not isinstance(v, Reset)}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


def project(env: dict[str, str]) -> dict[str, Any]:
    """docker-compose.yml with docker-compose.cpu.yml over it, interpolated with `env`."""
    main = interpolate(load(MAIN_FILE), env)
    over = interpolate(load(CPU_FILE), env)
    services = over.get("services", {})
    for name, service in services.items():
        if "extends" in service:
            extends = service.pop("extends")
            assert extends["file"] == MAIN_FILE.name, name
            services[name] = merge(main["services"][extends["service"]], service)
    merged = merge(
        {k: v for k, v in main.items() if not k.startswith("x-")},
        {k: v for k, v in over.items() if not k.startswith("x-")},
    )
    return merged


def cpu_env() -> dict[str, str]:
    """What scripts/compose_check.py gives compose: every required secret, plus the model and data folders."""
    return {**SECRETS, **extra_secrets(), "DAS_MODEL_DIR": "/models/smollm2", "DAS_DATA_DIR": "/data/das"}


def extra_secrets() -> dict[str, str]:
    names = set()
    for path in (MAIN_FILE, CPU_FILE):
        names |= set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*):\?", path.read_text()))
    return {name: f"{name.lower()}-secret" for name in names}


CPU = project(cpu_env())
SERVICES = CPU["services"]


def started() -> dict[str, dict[str, Any]]:
    """Services `docker compose up` starts (no profile)."""
    return {name: svc for name, svc in SERVICES.items() if not svc.get("profiles")}


def dockerfile(path: Path) -> list[tuple[str, str]]:
    """(instruction, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = "\n".join(lines).replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        if line.strip():
            instruction, _, args = line.strip().partition(" ")
            out.append((instruction.upper(), args.strip()))
    return out


def instruction(path: Path, name: str) -> list[str]:
    return [args for inst, args in dockerfile(path) if inst == name]


def build_file_of(image: str) -> Path:
    """The build file scripts/docker_images.sh makes `image` from (its default names)."""
    script = (REPO / "scripts" / "docker_images.sh").read_text()
    defaults = dict(re.findall(r"^(\w+)=\$\{\w+:-([^}]+)\}$", script, re.MULTILINE))
    builds = re.findall(r'build (\S+) "\$(\w+)" (\S+)', script)
    for _name, variable, file in builds:
        if defaults.get(variable) == image:
            return REPO / file
    raise AssertionError(f"scripts/docker_images.sh builds no image {image}")


# --------------------------------------------------------------------------------------------- the project
def test_the_merged_project_matches_the_compose_spec_schema() -> None:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(CPU), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_every_reference_resolves_in_the_merged_project() -> None:
    volumes, configs = set(CPU.get("volumes", {})), set(CPU.get("configs", {}))
    for name, service in started().items():
        for dependency in service.get("depends_on", {}):
            assert dependency in started(), f"{name} waits for {dependency}, which `up` does not start"
        for target, source in mounts(service).items():
            if not source.startswith((".", "/")):
                assert source in volumes, f"{name}: volume {source} at {target} is not declared"
            elif source.startswith("./"):
                assert (REPO / source).exists(), f"{name}: {source} is not in the repository"
        for entry in service.get("configs", []):
            assert entry["source"] in configs, f"{name}: config {entry['source']} is not declared"
        assert service.get("network_mode") != "host", f"{name} still uses the host's network"


def test_every_started_image_is_built_here_and_the_gpu_file_keeps_its_images() -> None:
    script = (REPO / "scripts" / "docker_images.sh").read_text()
    local = set(re.findall(r"^\w+_IMAGE=\$\{\w+:-([^}]+)\}$", script, re.MULTILINE))
    for name, service in started().items():
        assert service["image"] in local, f"{name}: {service['image']} is not one of the images built here"
        assert "deploy" not in service, f"{name} reserves devices"
    main = interpolate(load(MAIN_FILE), cpu_env())["services"]
    upstream = {
        "kafka-1": "apache/kafka:4.1.1",
        "kafka-jmx-agent": "maven:3.9.9-eclipse-temurin-17",
        "prometheus": "prom/prometheus:v2.53.2",
        "alertmanager": "prom/alertmanager:v0.27.0",
        "grafana": "grafana/grafana:11.2.0",
        "ray-head": "das-rollout:latest",
    }
    for name, image in upstream.items():
        assert main[name]["image"] == image, f"docker-compose.yml's {name} is no longer {image} by default"
    raw = MAIN_FILE.read_text()
    for line in re.findall(r"^\s*image: (.+)$", raw, re.MULTILINE):
        assert line.startswith("${") and ":-" in line, f"docker-compose.yml: image {line} is not a variable"


def test_no_container_takes_a_port_of_the_test_brokers_and_everything_binds_loopback() -> None:
    for name, service in started().items():
        for address, host_port, _container in published_ports(service):
            assert address == "127.0.0.1", f"{name} publishes on {address}"
            assert int(host_port) not in TEST_PORTS, f"{name} takes host port {host_port}"


def test_each_node_is_a_ray_worker_beside_its_own_replica_and_volume() -> None:
    volumes, groups = set(), set()
    for worker, replica in NODES.items():
        w, r = SERVICES[worker], SERVICES[replica]
        data = option(command_of(r), "--data")
        replica_volume = mounts(r)["/var/lib/das"]
        assert data.startswith("/var/lib/das/")
        assert mounts(w)["/var/lib/das"] == replica_volume, f"{worker} does not read {replica}'s store"
        assert w["depends_on"] == {replica: {"condition": "service_healthy"}} or set(w["depends_on"]) == {
            replica
        }
        volumes.add(replica_volume)
        groups.add(option(command_of(r), "--replica"))
        args = command_of(w)
        assert option(args, "--address") == "ray-head:6379"
        assert option(args, "--num-gpus") == "1", f"{worker}: one logical GPU per node"
    assert len(volumes) == len(NODES) and len(groups) == len(NODES), (volumes, groups)


def _driver_config() -> Any:
    """verl's config as the step driver composes it from the head's command (examples/verl plus overrides)."""
    from hydra import compose, initialize_config_dir

    command = command_of(SERVICES["ray-head"])
    trainer = command[command.index("--") + 1 :]
    assert trainer[:3] == ["python", "-m", "workers.verl.step_driver"]
    local = REPO / option(trainer, "--config-path").removeprefix("/opt/das/")
    overrides = [item for item in trainer[3:] if not item.startswith("--")]
    with initialize_config_dir(config_dir=str(local), version_base=None):
        return compose(config_name=option(trainer, "--config-name"), overrides=overrides)


def test_the_step_driver_gets_one_server_per_node_on_the_cpu_engine() -> None:
    config = _driver_config()
    rollout = config.actor_rollout_ref.rollout
    head = environment(SERVICES["ray-head"])
    # verl's standalone servers: nnodes x n_gpus_per_node logical GPUs, what the head waits for and the nodes give.
    assert rollout.nnodes * rollout.n_gpus_per_node == int(head["DAS_NODES"]) * int(head["DAS_GPUS_PER_NODE"])
    assert int(head["DAS_NODES"]) == len(NODES) and rollout.tensor_model_parallel_size == 1
    assert rollout.load_format != "dummy", "no trainer hands the servers weights: they must load the model"
    assert rollout.enable_sleep_mode is False and rollout.enforce_eager is True
    assert rollout.engine_kwargs.vllm.speculative_config.model == "workers.proposer.DasProposer"
    assert mounts(SERVICES["ray-head"])["/model"] == "/models/smollm2"
    for worker in NODES:
        assert mounts(SERVICES[worker])["/model"] == "/models/smollm2"
    brokers = config.das.bus.removeprefix("kafka://").split(",")
    for broker in brokers:
        host, port = broker.split(":")
        internal = environment(SERVICES[host])["KAFKA_LISTENERS"]
        assert f"INTERNAL://:{port}" in internal, broker
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.DAS_HISTORY_DIR.startswith("/var/lib/das/")
    port = head["DAS_STEP_DRIVER_PORT"]
    assert any(container == port for _a, _h, container in published_ports(SERVICES["ray-head"]))


def test_prometheus_scrapes_both_replicas_and_lists_no_absent_worker() -> None:
    target_dir = next(s for t, s in mounts(SERVICES["prometheus"]).items() if t == "/etc/prometheus/targets")
    folder = REPO / target_dir
    config = yaml.safe_load((REPO / "monitoring" / "prometheus" / "prometheus.yml").read_text())
    listed = []
    for job in config["scrape_configs"]:
        for sd in job.get("file_sd_configs", []):
            for path in sd["files"]:
                if path.startswith("/etc/prometheus/targets/"):
                    groups = yaml.safe_load((folder / path.rsplit("/", 1)[1]).read_text()) or []
                    listed += [t for g in groups for t in g["targets"]]
    replicas = {f"{name}:{METRICS_PORT}" for name in NODES.values()}
    assert set(listed) == replicas
    for target in listed:
        host, port = target.split(":")
        assert port in [str(p) for p in SERVICES[host]["expose"]]
        assert environment(SERVICES[host])["DAS_METRICS_PORT"] == port


def test_alertmanager_gets_the_shipped_route_with_a_url_it_understands() -> None:
    shipped = yaml.safe_load((REPO / "monitoring" / "alertmanager" / "alertmanager.yml").read_text())
    (entry,) = SERVICES["alertmanager"]["configs"]
    assert entry["target"] == "/etc/alertmanager/alertmanager.yml"
    config = yaml.safe_load(CPU["configs"][entry["source"]]["content"])
    assert config["route"]["receiver"] == shipped["route"]["receiver"]
    assert config["route"]["group_by"] == shipped["route"]["group_by"]
    assert [r["name"] for r in config["receivers"]] == [r["name"] for r in shipped["receivers"]]
    (hook,) = config["receivers"][0]["webhook_configs"]
    assert hook["send_resolved"] is True and "url_file" not in hook  # Alertmanager 0.25 has no url_file
    host, port = re.match(r"http://([\w-]+):(\d+)/", hook["url"]).groups()
    assert port in SERVICES[host]["expose"] and f"--port {port}" in " ".join(command_of(SERVICES[host]))


# --------------------------------------------------------------------------------------------- the build files
def test_the_das_image_builds_on_the_cpu_stack_and_holds_what_the_services_run() -> None:
    image = SERVICES["ray-head"]["image"]
    build = SERVICES["ray-head"]["build"]
    assert build["args"]["DAS_STACK"] == "cpu"
    assert build_file_of(build["args"]["DAS_BASE_IMAGE"]) == REPO / "docker" / "cpu-stack.Dockerfile"
    assert build_file_of(image) == REPO / "Dockerfile"
    (workdir,) = instruction(REPO / "Dockerfile", "WORKDIR")
    copied = " ".join(instruction(REPO / "Dockerfile", "COPY"))
    for name, service in started().items():
        if service["image"] != image:
            continue
        entry = service.get("entrypoint") or []
        for word in entry:
            if word.startswith(f"{workdir}/"):
                relative = word.removeprefix(f"{workdir}/")
                assert relative in copied and (REPO / relative).is_file(), f"{name}: {word} not in the image"
        command = command_of(service)
        if "-m" in command:
            module = command[command.index("-m") + 1]
            assert (REPO / (module.replace(".", "/") + ".py")).is_file(), f"{name}: no module {module}"
            assert f"COPY {module.split('.')[0]} " in "\n".join(
                f"COPY {c}" for c in instruction(REPO / "Dockerfile", "COPY")
            )
        if "healthcheck" in service:
            check = " ".join(service["healthcheck"]["test"][1:])
            assert "python3" in check  # on PATH: the CPU stack's venv comes first (below)
    stack = dict(
        re.findall(r"(\w+)=(\S+)", " ".join(instruction(REPO / "docker" / "cpu-stack.Dockerfile", "ENV")))
    )
    assert stack["PATH"].startswith("/opt/venv/bin:")
    assert instruction(REPO / "Dockerfile", "EXPOSE") == [METRICS_PORT]
    for name in NODES.values():
        assert environment(SERVICES[name])["DAS_METRICS_PORT"] == METRICS_PORT


def test_the_cpu_stack_installs_the_pins_setup_venv_reads() -> None:
    script = (REPO / "scripts" / "setup_venv.sh").read_text()
    read = set(re.findall(r"-r (requirements/\S+\.txt)", script))
    copied = " ".join(instruction(REPO / "docker" / "cpu-stack.Dockerfile", "COPY"))
    for path in read:
        assert path in copied, (
            f"docker/cpu-stack.Dockerfile does not copy {path}, which setup_venv.sh installs"
        )
    (run,) = [r for r in instruction(REPO / "docker" / "cpu-stack.Dockerfile", "RUN") if "setup_venv.sh" in r]
    assert "DAS_VENV_PROJECT=0" in run and "VENV=/opt/venv" in run
    assert 'if [ "${DAS_VENV_PROJECT:-1}" != 0 ]' in script


def test_the_kafka_image_keeps_the_apache_kafka_contract_compose_relies_on() -> None:
    broker = SERVICES["kafka-1"]
    path = build_file_of(broker["image"])
    users = instruction(path, "USER")
    assert users == ["appuser"] and "--uid 1000" in " ".join(instruction(path, "RUN"))  # apache/kafka's user
    # The health check's tool, at the path the main file names, and the data folder the volume mounts.
    check = " ".join(broker["healthcheck"]["test"][1:])
    tool = re.search(r"(/opt/kafka/bin/\S+\.sh)", check)[1]
    assert "docker/kafka/bin /opt/kafka/bin" in instruction(path, "COPY")
    assert (REPO / "docker" / "kafka" / "bin" / Path(tool).name).is_file()
    data = environment(broker)["KAFKA_LOG_DIRS"]
    assert data in mounts(broker) and json.loads(instruction(path, "VOLUME")[0]) == [data]
    assert data in " ".join(instruction(path, "RUN"))  # created (and owned by appuser) in the image
    # The agent jar: kafka-jmx-agent copies it from the image into the volume the brokers load it from.
    jar = re.search(r"-javaagent:(\S+?)=", environment(broker)["KAFKA_OPTS"])[1]
    fetch = SERVICES["kafka-jmx-agent"]
    assert fetch["image"] == broker["image"] and fetch["user"] == "root"
    script = command_of(fetch)[0]
    source = re.search(r"cp (\S+) ", script)[1]
    assert "build/docker/kafka/jmx-agent /opt/kafka/jmx-agent" in instruction(path, "COPY")
    assert source == f"/opt/kafka/jmx-agent/{Path(jar).name}"
    assert "-Dmdep.stripVersion=true" in (REPO / "scripts" / "docker_images.sh").read_text()
    held = next(t for t, s in mounts(broker).items() if jar.startswith(t + "/"))
    assert held in script


def test_the_kafka_entrypoint_turns_the_brokers_environment_into_its_properties(tmp_path: Path) -> None:
    broker = SERVICES["kafka-1"]
    env = {k: str(v) for k, v in environment(broker).items()}
    done = subprocess.run(
        ["bash", str(REPO / "docker" / "kafka" / "bin" / "run-broker.sh"), "--print-config"],
        env={"PATH": os.environ["PATH"], "DAS_KAFKA_CONFIG": str(tmp_path / "server.properties"), **env},
        capture_output=True,
        text=True,
        check=True,
    )
    properties = dict(line.split("=", 1) for line in done.stdout.splitlines())
    for name, value in env.items():
        if not name.startswith("KAFKA_") or name in ("KAFKA_OPTS", "KAFKA_HEAP_OPTS"):
            assert name.lower().replace("_", ".").removeprefix("kafka.") not in properties, name
            continue
        assert properties[name.removeprefix("KAFKA_").lower().replace("_", ".")] == value, name
    assert properties["listener.name.internal.plain.sasl.jaas.config"].endswith(";")
    assert properties["log.dirs"] == env["KAFKA_LOG_DIRS"] and properties["node.id"] == "1"


@pytest.mark.parametrize(
    ("service", "port", "data"),
    [("prometheus", "9090", "/prometheus"), ("alertmanager", "9093", "/alertmanager")],
)
def test_the_monitoring_images_run_their_binary_as_nobody_with_compose_s_flags(
    service: str, port: str, data: str
) -> None:
    svc = SERVICES[service]
    path = build_file_of(svc["image"])
    assert instruction(path, "USER") == ["65534:65534"]  # prom/*'s user
    assert instruction(path, "EXPOSE") == [port]
    assert any(container == port for _a, _h, container in published_ports(svc))
    (entrypoint,) = instruction(path, "ENTRYPOINT")
    assert json.loads(entrypoint)[0].startswith("/usr/bin/")  # the binary; compose gives only flags
    flags = command_of(svc)
    assert all(flag.startswith("--") for flag in flags)
    assert any(flag.endswith(f"={data}") for flag in flags)
    assert mounts(svc)[data].endswith("-data")
    assert json.loads(instruction(path, "VOLUME")[0]) == [data]
    assert f"chown -R 65534:65534 {data}" in " ".join(instruction(path, "RUN"))
    for entry in svc.get("configs", []):
        assert entry["target"].startswith(f"/etc/{service}/")


def test_compose_itself_merges_the_files_the_same_way(tmp_path: Path) -> None:
    compose = shutil.which("docker") and Path.home() / ".docker" / "cli-plugins" / "docker-compose"
    if not compose or not compose.exists():
        pytest.fail(
            "the Compose plugin is not installed: bash scripts/install_docker.sh --no-daemon (make test does)"
        )
    env_file = tmp_path / "env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in cpu_env().items()))
    done = subprocess.run(
        [
            str(compose),
            "-p",
            "das-test",
            "--env-file",
            str(env_file),
            "-f",
            str(MAIN_FILE),
            "-f",
            str(CPU_FILE),
            "config",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    theirs = json.loads(done.stdout)["services"]
    assert set(theirs) == set(started()), shlex.join(sorted(set(theirs) ^ set(started())))
    for name, service in started().items():
        assert theirs[name]["image"] == service["image"], name
        assert (theirs[name].get("command") or []) == command_of(service), name
        assert theirs[name].get("network_mode") == service.get("network_mode"), name
        assert {v["target"] for v in theirs[name].get("volumes", [])} == set(mounts(service)), name


# --------------------------------------------------------------------------------------------- the step driver
def test_the_step_driver_reports_each_rollout_as_das_agent_published_it() -> None:
    """verl left-pads prompts and right-pads responses; the driver's records (which the drill compares with the
    topic and the stores) must be the unpadded tokens under each row's DAS key."""
    import numpy as np
    import torch
    from verl import DataProto

    from workers.verl.identity import EPOCH_FIELD, PROBLEM_FIELD, SAMPLE_FIELD
    from workers.verl.step_driver import step_records

    prompts = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    responses = torch.tensor([[11, 12, 0], [13, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]])
    output = DataProto.from_dict({"prompts": prompts, "responses": responses, "attention_mask": mask})
    batch = DataProto.from_dict(
        tensors={"dummy": torch.zeros(2)},
        non_tensors={
            PROBLEM_FIELD: np.array(["p-1", "p-2"], dtype=object),
            EPOCH_FIELD: np.array([3, 0]),
            SAMPLE_FIELD: np.array([8, 1]),
        },
    )
    assert step_records(batch, output) == [
        {"problem_id": "p-1", "epoch": 3, "sample": 8, "prompt_ids": [5, 6], "response_ids": [11, 12]},
        {"problem_id": "p-2", "epoch": 0, "sample": 1, "prompt_ids": [7, 8, 9, 10], "response_ids": [13]},
    ]


def test_the_step_driver_retries_lost_servers_and_calls_but_not_its_own_errors() -> None:
    import ray.exceptions as errors

    from workers.verl.step_driver import _transient

    # As ray.get hands over a failure inside an agent loop worker: a RayTaskError whose text carries the cause.
    lost_call = errors.RayTaskError(
        "generate_sequences",
        "ray.exceptions.ActorUnavailableError: The actor is unavailable",
        RuntimeError("x"),
    )
    assert _transient(lost_call) and _transient(errors.ActorDiedError())
    try:
        try:
            raise errors.ActorDiedError()
        except errors.ActorDiedError as exc:
            raise RuntimeError("the step failed") from exc
    except RuntimeError as chained:
        assert _transient(chained)
    assert not _transient(ValueError("no prompts in /data/train.parquet"))
    assert not _transient(KeyError("das_problem_id"))
