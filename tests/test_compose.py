"""docker-compose.yml is a valid Compose file and a coherent deployment, checked without a Docker engine: the
compose-spec JSON schema, then the references between services, volumes, configs, Kafka and Prometheus."""

from __future__ import annotations

import json
import re
import shlex
from typing import Any
from urllib.parse import urlparse

import jsonschema
import pytest
import yaml
from monitoring_support import COMPOSE_FILE, COMPOSE_SCHEMA, GRAFANA, PROMETHEUS_CONFIG, REPO

METRICS_PORT = 9400
VARIABLE = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution (`${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`, `$$`)."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match["name"], match["op"], match["arg"]
        current = env.get(name)
        if op in (":-", ":?") and not current:
            current = None
        if current is not None:
            return current
        if op and op.endswith("?"):
            raise KeyError(f"required variable {name}: {arg}")
        return arg if op else ""

    return VARIABLE.sub(substitute, value)


RAW = yaml.safe_load(COMPOSE_FILE.read_text())
# The file as `docker compose config` would see it with no variables set: every default must work.
COMPOSE = interpolate(RAW, env={})
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]


def command_of(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else list(command)


def das_services() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in SERVICES.items() if command_of(svc)[:1] == ["das"]}


def option(command: list[str], flag: str) -> str:
    assert flag in command, f"{flag} missing from {command}"
    return command[command.index(flag) + 1]


def named_mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> source of each short-syntax volume entry."""
    mounts = {}
    for entry in service.get("volumes", []):
        source, target = entry.split(":")[:2]
        mounts[target] = source
    return mounts


def volume_holding(service: dict[str, Any], path: str) -> str | None:
    """The named volume whose mount point contains `path` in the service, or None (container file system)."""
    for target, source in sorted(named_mounts(service).items(), key=lambda item: -len(item[0])):
        if (path == target or path.startswith(target.rstrip("/") + "/")) and not source.startswith(
            (".", "/")
        ):
            return source
    return None


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


@pytest.mark.parametrize("document", [RAW, COMPOSE], ids=["as written", "interpolated"])
def test_compose_file_matches_the_compose_spec_schema(document: dict[str, Any]) -> None:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(document), key=lambda error: list(error.path))
    assert not errors, "\n".join(f"{list(error.path)}: {error.message}" for error in errors)


def test_interpolation_follows_compose_rules() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} ${UNSET} $$HOME", env) == "x d  d  $HOME"
    with pytest.raises(KeyError, match="NEEDED"):
        interpolate("${NEEDED:?set it}", env)


def test_every_dependency_volume_and_config_is_defined() -> None:
    volumes, configs = set(COMPOSE.get("volumes", {})), set(COMPOSE.get("configs", {}))
    for name, service in SERVICES.items():
        for dependency, spec in service.get("depends_on", {}).items():
            assert dependency in SERVICES, f"{name} depends on unknown service {dependency}"
            if spec["condition"] == "service_completed_successfully":
                assert SERVICES[dependency].get("restart") == "no", f"{dependency} must be one-shot"
        raw_entries = RAW["services"][name].get("volumes", [])
        for raw_entry, (target, source) in zip(raw_entries, named_mounts(service).items(), strict=True):
            if not source.startswith((".", "/")):
                assert source in volumes, f"{name} mounts undefined volume {source} at {target}"
            elif "${" not in raw_entry:
                # Sources chosen by a variable (the user's data folder) are the user's; ours must ship.
                assert (REPO / source).exists(), (
                    f"{name}: bind mount source {source} is not in the repository"
                )
        for entry in service.get("configs", []):
            assert entry["source"] in configs, f"{name} uses undefined config {entry['source']}"
    for name, config in COMPOSE.get("configs", {}).items():
        assert (REPO / config["file"]).is_file(), f"config {name}: {config['file']} does not exist"


def test_every_prometheus_target_is_a_compose_service_serving_metrics() -> None:
    prometheus = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = {
        target
        for job in prometheus["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    scraped = set()
    for target in targets:
        host, port = target.rsplit(":", 1)
        if host == "localhost":
            continue
        assert host in SERVICES, f"Prometheus target {target}: no compose service {host}"
        service = SERVICES[host]
        assert port in [str(p) for p in service.get("expose", [])], f"{host} does not expose {port}"
        assert environment(service).get("DAS_METRICS_PORT") == port, f"{host} serves metrics elsewhere"
        scraped.add(host)
    serving = {name for name, svc in SERVICES.items() if "DAS_METRICS_PORT" in environment(svc)}
    assert serving == scraped, (
        f"services serving /metrics that Prometheus does not scrape: {serving - scraped}"
    )


def test_prometheus_and_grafana_get_the_shipped_configuration() -> None:
    prometheus = SERVICES["prometheus"]
    mounted = {
        entry["target"]: COMPOSE["configs"][entry["source"]]["file"] for entry in prometheus["configs"]
    }
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    assert mounted["/etc/prometheus/prometheus.yml"] == "./monitoring/prometheus/prometheus.yml"
    for rule_file in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["rule_files"]:
        source = mounted[f"/etc/prometheus/{rule_file}"]
        assert (REPO / source).resolve() == (PROMETHEUS_CONFIG.parent / rule_file).resolve()
    grafana = named_mounts(SERVICES["grafana"])
    assert grafana["/etc/grafana/provisioning"] == "./monitoring/grafana/provisioning"
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "das.yml").read_text())["providers"][
        0
    ]
    assert grafana[provider["options"]["path"]] == "./monitoring/grafana/dashboards"
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert urlparse(datasource["datasources"][0]["url"]).hostname == "prometheus"


def test_kafka_is_a_three_broker_kraft_quorum_the_services_point_at() -> None:
    brokers = {
        name: environment(svc) for name, svc in SERVICES.items() if svc["image"].startswith("apache/kafka:")
    }
    assert len(brokers) == 3
    assert len({env["CLUSTER_ID"] for env in brokers.values()}) == 1
    node_ids = {env["KAFKA_NODE_ID"]: name for name, env in brokers.items()}
    assert len(node_ids) == 3
    for env in brokers.values():
        voters = dict(voter.split("@") for voter in env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(","))
        assert {node: address.split(":")[0] for node, address in voters.items()} == node_ids
        assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
        assert (
            int(env["KAFKA_MIN_INSYNC_REPLICAS"]) == 2 and int(env["KAFKA_DEFAULT_REPLICATION_FACTOR"]) == 3
        )
    internal = {
        next(a for a in env["KAFKA_ADVERTISED_LISTENERS"].split(",") if a.startswith("INTERNAL://"))[11:]
        for env in brokers.values()
    }
    for name, service in das_services().items():
        bus = option(command_of(service), "--bus")
        if bus == "embedded":
            assert not set(service.get("depends_on", {})) & set(brokers), (
                f"{name}: embedded bus needs no Kafka"
            )
            continue
        assert set(bus.removeprefix("kafka://").split(",")) == internal, f"{name}: bus {bus}"
        assert "kafka-init" in service["depends_on"] or name == "kafka-init"


def test_history_survives_restarts_and_rollout_workers_share_their_replica() -> None:
    volumes = set(COMPOSE["volumes"])
    replicas = {
        name: svc for name, svc in das_services().items() if command_of(svc)[1:3] == ["indexer", "run"]
    }
    assert len(replicas) >= 2
    names = [option(command_of(svc), "--replica") for svc in replicas.values()]
    assert len(set(names)) == len(names), f"replicas share a name (consumer group): {names}"
    replica_of_volume = {}
    for name, service in replicas.items():
        # Checkpoints go beside the store on the same volume (they hard-link its files).
        volume = volume_holding(service, option(command_of(service), "--data"))
        assert volume in volumes, f"{name}: its data is not on a named volume, a restart would lose it"
        assert volume not in replica_of_volume, f"{name} and {replica_of_volume.get(volume)} share a store"
        replica_of_volume[volume] = name
        assert "deploy" not in service, f"{name}: a history replica needs no GPU"
    workers = {name: svc for name, svc in das_services().items() if command_of(svc)[1] == "rollout"}
    for name, service in workers.items():
        volume = volume_holding(service, option(command_of(service), "--history-dir"))
        assert volume in volumes, f"{name}: its history is not on a named volume"
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in device["capabilities"] for device in devices), f"{name}: no GPU reservation"
        if option(command_of(service), "--bus") != "embedded":
            replica = replica_of_volume.get(volume)
            assert replica in service["depends_on"], (
                f"{name} reads {volume} but does not run beside its replica"
            )
    assert any("single-node" in svc.get("profiles", []) for svc in workers.values()), "no single-node profile"


def test_published_ports_bind_to_loopback_by_default_and_images_are_pinned() -> None:
    for name, service in SERVICES.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback by default"
        image = service["image"]
        if "build" in service:
            assert service["build"]["dockerfile"] == "Dockerfile"
        else:
            assert re.search(r":v?\d+\.\d+\.\d+$", image), f"{name}: image {image} is not pinned to a version"
    base = re.search(r"^FROM\s+(\S+)", (REPO / "Dockerfile").read_text(), re.MULTILINE)[1]
    assert re.search(r":v?\d+\.\d+\.\d+$", base), f"Dockerfile base {base} is not pinned"


def test_every_variable_is_documented_in_the_header() -> None:
    text = COMPOSE_FILE.read_text()
    header = text[: text.index("\nname:")]
    used = set(re.findall(r"\$\{([A-Za-z0-9_]+)", text))
    undocumented = sorted(
        name for name in used if not re.search(rf"^#\s+(\w+, )*{name}\b", header, re.MULTILINE)
    )
    assert not undocumented, (
        f"variables used but not described in the docker-compose.yml header: {undocumented}"
    )


def test_multiprocess_metrics_folders_start_empty() -> None:
    for name, service in SERVICES.items():
        folder = environment(service).get("PROMETHEUS_MULTIPROC_DIR")
        if folder is not None:
            # A tmpfs is empty at every container start: values of a previous run never add to this one's.
            assert folder in service.get("tmpfs", []), f"{name}: {folder} must be a tmpfs"


def _parse_error(arguments: list[str], capsys: pytest.CaptureFixture[str]) -> str | None:
    """The das CLI's complaint about `arguments`, or None when they parse."""
    from workers.cli import build_cli

    try:
        build_cli().parser.parse_args(arguments)
    except SystemExit:
        return capsys.readouterr().err.strip().splitlines()[-1]
    return None


@pytest.mark.parametrize("name", sorted(das_services()))
def test_compose_commands_parse_with_the_das_cli(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    command = command_of(SERVICES[name])
    error = _parse_error(command[1:], capsys)
    assert error is None, f"{name}: `{shlex.join(command)}` is not a valid das command: {error}"
