"""docker-compose.yml is a valid Compose file and a coherent training deployment, checked without a Docker engine:
the compose-spec JSON schema, then the references between services, volumes, configs, Kafka, Ray, verl and
Prometheus, with each command parsed by the real tool's parser (das, `ray start`, verl's Hydra config)."""

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

METRICS_PORT = "9400"
JMX_AGENT_PORT = "7071"
VARIABLE = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")
# The secrets a user must set (in .env): compose refuses to start without them instead of using a known default.
SECRETS = {
    "DAS_KAFKA_SASL_PASSWORD": "client-secret",
    "DAS_KAFKA_TRAINER_PASSWORD": "trainer-secret",
    "DAS_KAFKA_REPLICA_PASSWORD": "replica-secret",
    "DAS_KAFKA_ADMIN_PASSWORD": "admin-secret",
    "DAS_GRAFANA_ADMIN_PASSWORD": "grafana-secret",
}
# Where the image puts the repository (Dockerfile WORKDIR).
IMAGE_ROOT = "/opt/das"


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
# The file as `docker compose config` sees it with only the required secrets set: every other default must work.
COMPOSE = interpolate(RAW, env=SECRETS)
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]


def command_of(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else list(command)


def das_services() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in SERVICES.items() if command_of(svc)[:1] == ["das"]}


RAY_WORKER_ENTRYPOINT = ["bash", f"{IMAGE_ROOT}/scripts/ray_worker.sh"]


def ray_workers() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in SERVICES.items() if svc.get("entrypoint") == RAY_WORKER_ENTRYPOINT}


def worker_start_args(service: dict[str, Any]) -> list[str]:
    """The `ray start` arguments of a Ray worker (scripts/ray_worker.sh adds --block, and the node address only
    when DAS_NODE_IP is set)."""
    return ["--block", *command_of(service)]


def option(command: list[str], flag: str) -> str:
    """The value of `--flag value` or `--flag=value`."""
    for index, item in enumerate(command):
        if item == flag:
            return command[index + 1]
        if item.startswith(f"{flag}="):
            return item.split("=", 1)[1]
    raise AssertionError(f"{flag} missing from {command}")


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> source of each short-syntax volume entry."""
    result = {}
    for entry in service.get("volumes", []):
        source, target = entry.split(":")[:2]
        result[target] = source
    return result


def is_named_volume(source: str) -> bool:
    return not source.startswith((".", "/"))


def volume_holding(service: dict[str, Any], path: str) -> tuple[str, str] | None:
    """(named volume, its mount point) whose mount point contains `path`, or None (container file system)."""
    for target, source in sorted(mounts(service).items(), key=lambda item: -len(item[0])):
        if (path == target or path.startswith(target.rstrip("/") + "/")) and is_named_volume(source):
            return source, target
    return None


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def head_command() -> tuple[list[str], list[str]]:
    """The Ray head's (`ray start --head` flags, trainer command), split at `--` as scripts/ray_head.sh does."""
    head = SERVICES["ray-head"]
    assert head["entrypoint"] == ["bash", f"{IMAGE_ROOT}/scripts/ray_head.sh"]
    command = command_of(head)
    split = command.index("--")
    return command[:split], command[split + 1 :]


def dependencies(name: str) -> set[str]:
    """Every service `name` waits for, directly or through others."""
    direct = set(SERVICES[name].get("depends_on", {}))
    return direct.union(*(dependencies(dependency) for dependency in direct))


def replicas() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in das_services().items() if command_of(svc)[1:3] == ["indexer", "run"]}


def replica_by_volume() -> dict[str, tuple[str, str]]:
    """Named volume -> (replica service, its --data path)."""
    result = {}
    for name, service in replicas().items():
        data = option(command_of(service), "--data")
        held = volume_holding(service, data)
        assert held is not None, f"{name}: its data is not on a named volume, a restart would lose it"
        assert held[0] not in result, f"{name} and {result[held[0]][0]} share a store"
        result[held[0]] = (name, data)
    return result


def published_ports(service: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(host address, host port, container port) of each `addr:host:container` entry."""
    result = []
    for entry in service.get("ports", []):
        address, host_port, container_port = str(entry).rsplit(":", 2)
        result.append((address, host_port, container_port))
    return result


def host_network_ports(name: str, service: dict[str, Any]) -> set[str]:
    """Fixed ports a host-network Ray container listens on, from its `ray start` flags (Ray's defaults included)."""
    if name == "ray-head":
        flags = head_command()[0]
        parsed = _ray_start_params(["--head", *flags])
        ports = {parsed["port"], parsed["dashboard_port"], parsed["ray_client_server_port"]}
    else:
        parsed = _ray_start_params(worker_start_args(service))
        ports = set()
    ports |= {parsed["metrics_export_port"], parsed["dashboard_agent_listen_port"]}
    return {str(port) for port in ports if port}


def _ray_start_params(arguments: list[str]) -> dict[str, Any]:
    """`ray start`'s own click parser: unknown flags and bad values raise click's UsageError."""
    from ray.scripts.scripts import start

    return start.make_context("start", list(arguments)).params


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


def test_passwords_must_be_set_and_nothing_else_is_required() -> None:
    for secret in SECRETS:
        with pytest.raises(KeyError, match=secret):
            interpolate(RAW, env={k: v for k, v in SECRETS.items() if k != secret})
    required = set(re.findall(r"\$\{([A-Za-z0-9_]+):\?", COMPOSE_FILE.read_text()))
    assert required == set(SECRETS)


def test_every_dependency_volume_and_config_is_defined() -> None:
    volumes, configs = set(COMPOSE.get("volumes", {})), set(COMPOSE.get("configs", {}))
    for name, service in SERVICES.items():
        for dependency, spec in service.get("depends_on", {}).items():
            assert dependency in SERVICES, f"{name} depends on unknown service {dependency}"
            if spec["condition"] == "service_completed_successfully":
                assert SERVICES[dependency].get("restart") == "no", f"{dependency} must be one-shot"
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in SERVICES[dependency], (
                    f"{name} waits for {dependency}, which has no check"
                )
        raw_entries = RAW["services"][name].get("volumes", [])
        for raw_entry, (target, source) in zip(raw_entries, mounts(service).items(), strict=True):
            if is_named_volume(source):
                assert source in volumes, f"{name} mounts undefined volume {source} at {target}"
            elif "${" not in raw_entry:
                # Sources chosen by a variable (the user's data folder) are the user's; ours must ship.
                assert (REPO / source).exists(), (
                    f"{name}: bind mount source {source} is not in the repository"
                )
        for entry in service.get("configs", []):
            assert entry["source"] in configs, f"{name} uses undefined config {entry['source']}"
    for name, config in COMPOSE.get("configs", {}).items():
        if "content" in config:  # written by compose (from a variable): nothing to ship
            continue
        assert (REPO / config["file"]).is_file(), f"config {name}: {config['file']} does not exist"


def _serves_metrics_on(service: dict[str, Any]) -> set[str]:
    """Ports on which a compose service serves /metrics: DAS's server, or the Kafka brokers' JMX agent."""
    env = environment(service)
    ports = {env["DAS_METRICS_PORT"]} if "DAS_METRICS_PORT" in env else set()
    agent = re.search(r"-javaagent:\S*jmx_prometheus_javaagent\.jar=(\d+):", env.get("KAFKA_OPTS", ""))
    if agent:
        ports.add(agent[1])
    return ports


def _scrape_jobs() -> dict[str, dict[str, Any]]:
    return {job["job_name"]: job for job in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]}


def _shipped_targets(job: dict[str, Any]) -> list[str]:
    """Targets of the repository's own file_sd files a job reads (the replicas' list)."""
    targets = []
    for sd in job.get("file_sd_configs", []):
        for path in sd["files"]:
            source, relative = _prometheus_path_source(path)
            if not is_named_volume(source):
                for group in yaml.safe_load((REPO / source / relative).read_text()) or []:
                    targets += group["targets"]
    return targets


def test_every_service_prometheus_targets_is_a_compose_service_serving_metrics() -> None:
    scraped = set()
    for job in _scrape_jobs().values():
        static = [target for group in job.get("static_configs", []) for target in group["targets"]]
        for group in [{"targets": static + _shipped_targets(job)}]:
            for target in group["targets"]:
                host, port = target.rsplit(":", 1)
                if host == "localhost":
                    continue
                assert host in SERVICES, f"Prometheus target {target}: no compose service {host}"
                service = SERVICES[host]
                assert port in [str(p) for p in service.get("expose", [])], f"{host} does not expose {port}"
                assert port in _serves_metrics_on(service), f"{host} serves no /metrics on {port}"
                scraped.add(host)
    serving = {
        name for name, svc in SERVICES.items() if _serves_metrics_on(svc) and "network_mode" not in svc
    }
    assert serving == scraped, (
        f"services serving /metrics that Prometheus does not scrape: {serving - scraped}"
    )


def _prometheus_path_source(path: str) -> tuple[str, str]:
    """(source, container path) Prometheus reads `path` from: a named volume or a repository folder."""
    held = sorted(mounts(SERVICES["prometheus"]).items(), key=lambda item: -len(item[0]))
    for target, source in held:
        if path.startswith(target.rstrip("/") + "/"):
            return source, path[len(target) :].lstrip("/")
    raise AssertionError(f"Prometheus reads {path}, which no volume or bind mount provides")


def test_discovered_targets_come_from_the_ray_head_and_host_targets_from_published_ports() -> None:
    head = SERVICES["ray-head"]
    for job_name, job in _scrape_jobs().items():
        for sd in job.get("file_sd_configs", []):
            for path in sd["files"]:
                source, relative = _prometheus_path_source(path)
                if is_named_volume(source):
                    # Written at run time in the Ray head: the vLLM server list and Ray's own discovery file.
                    writer_mount = next(t for t, s in mounts(head).items() if s == source)
                    written = f"{writer_mount.rstrip('/')}/{relative}"
                    if job_name == "vllm":
                        assert environment(head)["DAS_VLLM_TARGETS"] == written
                    elif job_name == "das-proposer":
                        # `das monitoring vllm-targets --proposers` writes it beside the vLLM server list.
                        vllm_list = environment(head)["DAS_VLLM_TARGETS"]
                        assert written == f"{vllm_list.rsplit('/', 1)[0]}/das-proposers.json"
                    else:
                        assert written == "/tmp/ray/prom_metrics_service_discovery.json", job_name
                    continue
                # A shipped file of targets: this host's replica service (checked with the static targets), or
                # GPU hosts' replicas, each at a port some service publishes.
                shipped = REPO / source / relative
                assert shipped.is_file(), f"{job_name}: {shipped} is not in the repository"
                for group in yaml.safe_load(shipped.read_text()) or []:
                    for target in group["targets"]:
                        host, port = target.rsplit(":", 1)
                        assert host in SERVICES or any(
                            published == port and container in _serves_metrics_on(svc)
                            for svc in SERVICES.values()
                            for _addr, published, container in published_ports(svc)
                        ), f"{shipped}: {target} is not a published /metrics port"


def test_host_targets_file_accepts_gpu_host_entries() -> None:
    """docs/deployment.md's multi-host step: each GPU host's replica, at the port `history` publishes, replaces the local one."""
    port = next(p for _a, p, c in published_ports(SERVICES["history"]) if c == METRICS_PORT)
    shipped = (REPO / "monitoring" / "prometheus" / "targets" / "replicas.yml").read_text()
    assert f'"10.0.0.11:{port}"' in shipped, "the file's example names the published port"
    # No static replica target: on a head host without a replica it would never resolve (DASTargetDown).
    assert "static_configs" not in _scrape_jobs()["das-indexer"]


def test_prometheus_alertmanager_and_grafana_get_the_shipped_configuration() -> None:
    prometheus = SERVICES["prometheus"]
    mounted = {
        entry["target"]: COMPOSE["configs"][entry["source"]]["file"] for entry in prometheus["configs"]
    }
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    assert mounted["/etc/prometheus/prometheus.yml"] == "./monitoring/prometheus/prometheus.yml"
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    for rule_file in config["rule_files"]:
        source = mounted[f"/etc/prometheus/{rule_file}"]
        assert (REPO / source).resolve() == (PROMETHEUS_CONFIG.parent / rule_file).resolve()
    (alertmanager_target,) = config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    host, port = alertmanager_target.split(":")
    assert "--config.file=/etc/alertmanager/alertmanager.yml" in SERVICES[host]["command"]
    assert any(container == port for _a, _p, container in published_ports(SERVICES[host]))
    assert yaml.safe_load((REPO / "monitoring" / "alertmanager" / "alertmanager.yml").read_text())["route"]
    # The operator's webhook URL reaches the file the receiver reads (tests/test_monitoring_alertmanager.py).
    mounted = {entry["target"]: entry["source"] for entry in SERVICES[host]["configs"]}
    hook = interpolate(RAW, {**SECRETS, "DAS_ALERT_WEBHOOK_URL": "https://relay.example/das"})
    assert hook["configs"][mounted["/etc/alertmanager/webhook-url"]]["content"] == "https://relay.example/das"
    grafana = mounts(SERVICES["grafana"])
    assert grafana["/etc/grafana/provisioning"] == "./monitoring/grafana/provisioning"
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "das.yml").read_text())["providers"][
        0
    ]
    assert grafana[provider["options"]["path"]] == "./monitoring/grafana/dashboards"
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert urlparse(datasource["datasources"][0]["url"]).hostname == "prometheus"


def _brokers() -> dict[str, dict[str, str]]:
    return {
        name: environment(svc) for name, svc in SERVICES.items() if svc["image"].startswith("apache/kafka:")
    }


def _listeners(env: dict[str, str], name: str) -> str:
    return next(a for a in env["KAFKA_ADVERTISED_LISTENERS"].split(",") if a.startswith(f"{name}://"))[
        len(name) + 3 :
    ]


def test_kafka_is_a_three_broker_kraft_quorum_the_services_point_at() -> None:
    brokers = _brokers()
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
    internal = {_listeners(env, "INTERNAL") for env in brokers.values()}
    external = {_listeners(env, "EXTERNAL") for env in brokers.values()}
    for name, service in das_services().items():
        bus = option(command_of(service), "--bus")
        if bus == "embedded":
            assert not set(service.get("depends_on", {})) & set(brokers), (
                f"{name}: embedded bus needs no Kafka"
            )
            continue
        assert set(bus.removeprefix("kafka://").split(",")) == internal, f"{name}: bus {bus}"
        assert name == "kafka-init" or "kafka-init" in dependencies(name), (
            f"{name} may start before the topics"
        )
    # The trainer's agent loops run in host-network Ray containers: they reach the external listeners.
    trainer_bus = next(o for o in head_command()[1] if o.startswith("das.bus="))
    assert set(trainer_bus.split("=", 1)[1].strip("'").removeprefix("kafka://").split(",")) == external


def test_every_client_logs_in_with_a_user_the_brokers_know() -> None:
    brokers = _brokers()
    for env in brokers.values():
        protocols = dict(entry.split(":") for entry in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
        assert protocols["INTERNAL"].startswith("SASL_") and protocols["EXTERNAL"].startswith("SASL_")
        for listener in ("INTERNAL", "EXTERNAL"):
            jaas = env[f"KAFKA_LISTENER_NAME_{listener}_PLAIN_SASL_JAAS_CONFIG"]
            users = dict(re.findall(r'user_(\w+)="([^"]*)"', jaas))
            users = dict(re.findall(r'user_([\w-]+)="([^"]*)"', jaas))
            assert users == {
                "admin": SECRETS["DAS_KAFKA_ADMIN_PASSWORD"],
                "das": SECRETS["DAS_KAFKA_SASL_PASSWORD"],
                "das-trainer": SECRETS["DAS_KAFKA_TRAINER_PASSWORD"],
                "das-replica": SECRETS["DAS_KAFKA_REPLICA_PASSWORD"],
            }
    from pipeline.kafka_config import ENV_SETTINGS

    # Each client logs in as its role: what the brokers' ACLs (kafka-init's grants) let it do.
    logins = {"rollout": ("das", "client-secret"), "replica": ("das-replica", "replica-secret")}
    clients = {**das_services(), "ray-head": SERVICES["ray-head"], **ray_workers()}
    for name, service in clients.items():
        env = environment(service)
        if name == "single-node":
            continue
        assert env["DAS_KAFKA_SECURITY_PROTOCOL"] == protocols["INTERNAL"], name
        role = (
            "admin"
            if name == "kafka-init"
            else "replica"
            if "indexer" in str(service.get("command"))
            else "rollout"
        )
        want = ("admin", "admin-secret") if role == "admin" else logins[role]
        assert (env["DAS_KAFKA_SASL_USERNAME"], env["DAS_KAFKA_SASL_PASSWORD"]) == want, name
        # Only the trainer's side may write epoch advances: verl's trainer (on any Ray node) and `das rollout`.
        trainer = name in ("ray-head", *ray_workers()) or command_of(service)[:2] == ["das", "rollout"]
        login = (env.get("DAS_KAFKA_CONTROL_SASL_USERNAME"), env.get("DAS_KAFKA_CONTROL_SASL_PASSWORD"))
        assert login == (("das-trainer", "trainer-secret") if trainer else (None, None)), name
        assert {k for k in env if k.startswith("DAS_KAFKA_") and k in ENV_SETTINGS} >= {
            "DAS_KAFKA_SECURITY_PROTOCOL",
            "DAS_KAFKA_SASL_MECHANISM",
        }
    for env in brokers.values():  # nothing is allowed but what kafka-init grants
        assert env["KAFKA_AUTHORIZER_CLASS_NAME"] == "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
        assert env["KAFKA_SUPER_USERS"] == "User:admin;User:ANONYMOUS"
    init = command_of(SERVICES["kafka-init"])
    grants = {flag: init[init.index(flag) + 1] for flag in init if flag.endswith("-principal")}
    assert grants == {
        "--rollout-principal": "User:das",
        "--trainer-principal": "User:das-trainer",
        "--replica-principal": "User:das-replica",
    }


def test_brokers_topic_and_clients_share_one_message_size() -> None:
    for env in _brokers().values():
        assert env["KAFKA_MESSAGE_MAX_BYTES"] == env["KAFKA_REPLICA_FETCH_MAX_BYTES"]
        size = env["KAFKA_MESSAGE_MAX_BYTES"]
    for name, service in das_services().items():
        if name != "single-node":
            assert environment(service)["DAS_KAFKA_MAX_MESSAGE_BYTES"] == size, name


def test_brokers_load_the_jmx_agent_the_local_brokers_use() -> None:
    pom = (REPO / "scripts" / "kafka" / "pom.xml").read_text()
    version = re.search(r"<jmx.exporter.version>([^<]+)<", pom)[1]
    fetch = SERVICES["kafka-jmx-agent"]
    assert command_of(fetch)[:2] == ["sh", "-c"]
    script = shlex.split(command_of(fetch)[2])
    assert f"-Dartifact=io.prometheus.jmx:jmx_prometheus_javaagent:{version}" in script
    output = option(script, "-DoutputDirectory")
    agent_volume = mounts(fetch)[output]
    # Resolved once: the download runs only when the marker of this version, written after it, is missing.
    marker = f"{output}/jmx_prometheus_javaagent-{version}.done"
    assert script[:3] == ["test", "-s", marker] and script[-1] == f">{marker})", script
    for name in _brokers():
        broker = SERVICES[name]
        jar, _port, rules = re.search(
            r"-javaagent:(\S+)=(\d+):(\S+)", environment(broker)["KAFKA_OPTS"]
        ).groups()
        held = volume_holding(broker, jar)
        assert held is not None and held[0] == agent_volume, f"{name}: agent jar not from kafka-jmx-agent"
        assert mounts(broker)[rules] == "./monitoring/prometheus/kafka-jmx.yml", name
        assert broker["depends_on"]["kafka-jmx-agent"]["condition"] == "service_completed_successfully"
        # Kafka's tool scripts pass KAFKA_OPTS to their JVMs too: one in the health check would start a second
        # agent on the broker's port and fail.
        check = " ".join(broker["healthcheck"]["test"][1:])
        assert re.search(r"(^|\s)KAFKA_OPTS= \S*kafka-broker-api-versions\.sh", check), check


def trainer_config(replace: dict[str, str] | None = None) -> Any:
    """verl's config as the Ray head's trainer composes it (examples/verl plus the compose file's overrides),
    with the overrides named in `replace` given other values (the loopback rehearsal's paths) or added."""
    from hydra import compose, initialize_config_dir

    _flags, trainer = head_command()
    assert trainer[:3] == ["python", "-m", "verl.trainer.main_ppo"]
    config_dir = option(trainer, "--config-path")
    assert config_dir.startswith(f"{IMAGE_ROOT}/")
    overrides = [item for item in trainer[3:] if not item.startswith("--")]
    replace = dict(replace or {})
    overrides = [
        f"{key}={replace.pop(key)}" if key in replace else item
        for item in overrides
        for key in [item.split("=", 1)[0]]
    ] + [f"{key}={value}" for key, value in replace.items()]
    local_dir = REPO / config_dir.removeprefix(f"{IMAGE_ROOT}/")
    with initialize_config_dir(config_dir=str(local_dir), version_base=None):
        return compose(config_name=option(trainer, "--config-name"), overrides=overrides)


def test_each_gpu_node_reads_its_own_replica() -> None:
    by_volume = replica_by_volume()
    assert len(by_volume) == 1, "one replica per host"
    names = [option(command_of(svc), "--replica") for svc in replicas().values()]
    assert len(set(names)) == len(names), f"replicas share a name (consumer group): {names}"
    for name, service in replicas().items():
        assert "deploy" not in service, f"{name}: a history replica needs no GPU"
    # The path reaches every process of every node through Ray's job-wide runtime environment (verl merges
    # ray_kwargs.ray_init into ray.init), so each node must have its own replica's folder at that path.
    history_dir = trainer_config().ray_kwargs.ray_init.runtime_env.env_vars.DAS_HISTORY_DIR
    used_by: dict[str, str] = {}
    for name, service in ray_workers().items():
        assert "DAS_HISTORY_DIR" not in environment(service), f"{name}: the runtime environment overrides it"
        held = volume_holding(service, history_dir)
        assert held is not None, f"{name}: {history_dir} is not on a replica's volume"
        replica, data = by_volume[held[0]]
        # The same folder the replica writes, seen through the same mount point.
        replica_mount = next(t for t, s in mounts(SERVICES[replica]).items() if s == held[0])
        assert (held[1], history_dir) == (replica_mount, data), name
        assert held[0] not in used_by, f"{name} and {used_by.get(held[0])} read one replica"
        used_by[held[0]] = name
        assert service["depends_on"][replica] == {"condition": "service_healthy"}, name
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in device["capabilities"] for device in devices), f"{name}: no GPU reservation"
    assert len(used_by) == len(by_volume), "a replica no Ray worker reads"


def test_one_ray_node_per_host_holds_all_the_gpus_the_trainer_counts_per_node() -> None:
    (worker,) = ray_workers().values()
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    gpus = ",".join(device["device_ids"]).split(",")
    config = trainer_config()
    assert len(set(gpus)) == len(gpus) == config.trainer.n_gpus_per_node
    # The head waits for exactly what the trainer asks for.
    head = environment(SERVICES["ray-head"])
    assert int(head["DAS_NODES"]) == config.trainer.nnodes
    assert int(head["DAS_GPUS_PER_NODE"]) == config.trainer.n_gpus_per_node
    # NCCL pins memory: no memlock limit on GPU nodes.
    assert worker["ulimits"]["memlock"] == -1


def test_bench_workers_roll_out_disjoint_problem_shards() -> None:
    bench = {
        name: svc
        for name, svc in das_services().items()
        if command_of(svc)[1] == "rollout" and option(command_of(svc), "--bus") != "embedded"
    }
    assert bench and all("bench" in svc["profiles"] for svc in bench.values())
    shards = sorted(option(command_of(svc), "--shard") for svc in bench.values())
    assert shards == [f"{i}/{len(bench)}" for i in range(len(bench))], shards
    by_volume = replica_by_volume()
    for name, service in bench.items():
        held = volume_holding(service, option(command_of(service), "--history-dir"))
        replica, data = by_volume[held[0]]
        assert option(command_of(service), "--history-dir") == data
        assert service["depends_on"][replica] == {"condition": "service_healthy"}, name


def test_ray_commands_parse_with_ray_start_and_workers_join_the_head() -> None:
    head_flags, _trainer = head_command()
    head = _ray_start_params(["--head", *head_flags])
    assert head["num_gpus"] == 0, "the head runs the driver only; GPUs belong to the node containers"
    for name, service in ray_workers().items():
        params = _ray_start_params(worker_start_args(service))
        assert params["block"], (
            f"{name}: `ray start` must stay in the foreground (the container lives with it)"
        )
        host, port = params["address"].rsplit(":", 1)
        assert int(port) == head["port"], f"{name} joins port {port}, the head listens on {head['port']}"
    for name in ("ray-head", *ray_workers()):
        assert SERVICES[name]["network_mode"] == "host", f"{name}: Ray and NCCL need the host's network"


def test_ray_nodes_on_one_host_take_worker_ports_from_separate_ranges() -> None:
    ranges = {"ray-head": _ray_start_params(["--head", *head_command()[0]])}
    ranges |= {name: _ray_start_params(worker_start_args(svc)) for name, svc in ray_workers().items()}
    spans = sorted((p["min_worker_port"], p["max_worker_port"], name) for name, p in ranges.items())
    for (_low, high, name), (next_low, _high, next_name) in zip(spans, spans[1:], strict=False):
        assert high < next_low, f"{name} and {next_name} share worker ports"
    fixed = {
        int(port)
        for name, svc in SERVICES.items()
        if svc.get("network_mode") == "host"
        for port in host_network_ports(name, svc)
    }
    assert not any(low <= port <= high for low, high, _ in spans for port in fixed)


def test_published_and_host_network_ports_do_not_collide() -> None:
    taken: dict[tuple[str, str], str] = {}

    def take(address: str, port: str, owner: str) -> None:
        for (other_address, other_port), other in taken.items():
            overlap = address == other_address or "0.0.0.0" in (address, other_address)
            assert not (overlap and port == other_port), f"{owner} and {other} both bind {address}:{port}"
        taken[(address, port)] = owner

    for name, service in SERVICES.items():
        for address, port, _container in published_ports(service):
            take(address, port, name)
        if service.get("network_mode") == "host":
            for port in host_network_ports(name, service):
                take("0.0.0.0", port, name)


def test_trainer_command_composes_with_verls_config_and_passes_its_checks() -> None:
    from verl.trainer.main_ppo import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    config = trainer_config()
    validate_config(
        config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
    )
    workers = ray_workers()
    assert config.trainer.nnodes == len(workers), "the trainer waits for a node the file does not start"
    assert config.trainer.resume_mode == "auto"
    assert config.trainer.n_gpus_per_node % config.actor_rollout_ref.rollout.tensor_model_parallel_size == 0
    checkpoints = volume_holding(SERVICES["ray-head"], config.trainer.default_local_dir)
    assert checkpoints is not None, "verl checkpoints must be on a named volume to survive a restart"
    for name, service in workers.items():
        # FSDP ranks write their shards on their own node: the same volume at the same path.
        assert volume_holding(service, config.trainer.default_local_dir) == checkpoints, name
        for path in (config.actor_rollout_ref.model.path, config.data.train_files, config.data.val_files):
            assert any(path.startswith(target + "/") or path == target for target in mounts(service)), (
                name,
                path,
            )
    assert config.das.bus.startswith("kafka://")
    router = config.actor_rollout_ref.rollout.router_config_path
    assert (REPO / router.removeprefix(f"{IMAGE_ROOT}/")).is_file(), router


def test_restart_policies_resume_but_never_loop_on_a_failure() -> None:
    for name, service in SERVICES.items():
        policy = service.get("restart", "no")
        if any(
            spec["condition"] == "service_completed_successfully" and dep == name
            for svc in SERVICES.values()
            for dep, spec in svc.get("depends_on", {}).items()
        ):
            assert policy == "no", f"{name} is one-shot"
        elif name == "ray-head":
            # A trainer that fails (its nodes late, a crash) restarts and resumes as often as it takes: Docker's
            # on-failure:N counts failures over the container's whole life, not in a row.
            assert policy == "on-failure", f"{name}: {policy}"
        elif "profiles" in service:
            # Benchmark epochs restart after a crash, a bounded number of times.
            assert re.fullmatch(r"on-failure:[1-5]", policy), f"{name}: {policy}"
        else:
            assert policy == "unless-stopped", f"{name}: {policy}"


def test_published_ports_bind_to_loopback_by_default_and_images_are_pinned() -> None:
    for name, service in SERVICES.items():
        for address, _port, _container in published_ports(service):
            assert address == "127.0.0.1", f"{name} publishes beyond loopback by default"
        image = service["image"]
        if "build" in service:
            assert service["build"]["dockerfile"] == "Dockerfile"
        else:
            assert re.search(r":v?\d+\.\d+\.\d+(-[\w.-]+)?$", image), f"{name}: image {image} is not pinned"


def dockerfile_base(build_args: dict[str, str]) -> str:
    """The image the Dockerfile's first FROM names, as Docker resolves it: `ARG`s declared before it (with their
    defaults) may be substituted there, and a build argument replaces an ARG's default."""
    text = (REPO / "Dockerfile").read_text()
    head, _, rest = text.partition("\nFROM ")
    defaults = dict(re.findall(r"^ARG (\w+)=(\S+)$", head, re.MULTILINE))
    values = {**defaults, **{k: v for k, v in build_args.items() if k in defaults}}
    return re.sub(r"\$\{(\w+)\}", lambda m: values[m[1]], rest.split()[0])


def test_the_base_image_is_pinned_by_digest_and_a_build_argument_replaces_it() -> None:
    digest = "verlai/verl:vllm024.dev2@sha256:"
    base = dockerfile_base({})
    # verl 0.9.1 pins vllm==0.24.0: verl's vLLM 0.24 image, by digest (the tag is mutable).
    assert base.startswith(digest) and re.fullmatch(r"[0-9a-f]{64}", base[len(digest) :]), base
    # Compose builds on the same pin unless DAS_BASE_IMAGE says otherwise, and the build argument replaces it.
    repinned = digest + "0" * 64
    override = interpolate(RAW, {**SECRETS, "DAS_BASE_IMAGE": repinned})["services"]
    for name, service in SERVICES.items():
        if "build" in service:
            assert dockerfile_base(service["build"]["args"]) == base, name
            assert dockerfile_base(override[name]["build"]["args"]) == repinned, name


def test_dockerfile_installs_dependencies_before_code_within_the_base_constraints() -> None:
    instructions = (REPO / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    steps = [line for line in instructions if re.match(r"^(RUN|COPY)\b", line)]
    text = "\n".join(steps)
    freeze = next(i for i, s in enumerate(steps) if "pip list --format=freeze" in s)
    install = next(i for i, s in enumerate(steps) if "-c constraints.txt" in s)
    first_code = min(
        i for i, s in enumerate(steps) if re.match(r"COPY (pipeline|history_store|workers|monitoring)\b", s)
    )
    assert freeze < install < first_code, text
    assert all(
        not s.startswith("COPY") or "requirements" in s or "pyproject" in s or "merge_constraints" in s
        for s in steps[:install]
    ), text
    # The base installs its stack with --no-deps: `pip check` reports its gaps, not ours. The build ends by
    # importing what the trainer and the servers import, TransferQueue included (installed, not inherited).
    assert "pip check" not in text
    assert "import transfer_queue" in steps[-1] and "TransferQueue" in steps[install]
    ignored = set((REPO / ".dockerignore").read_text().split())
    for needed in ("examples", "scripts", "pipeline", "workers"):
        assert needed not in ignored, f".dockerignore drops {needed}, which the image copies"


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


def test_the_ray_head_keeps_the_vllm_target_list_with_a_valid_das_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    script = (REPO / "scripts" / "ray_head.sh").read_text()
    call = re.search(r"^\s*(das monitoring vllm-targets .*?) &$", script, re.MULTILINE)[1]
    arguments = shlex.split(
        call.replace('"$DAS_VLLM_TARGETS"', environment(SERVICES["ray-head"])["DAS_VLLM_TARGETS"])
    )
    assert _parse_error(arguments[1:], capsys) is None
    # The proposers note their /metrics where the head looks: the trainer's job-wide environment says where.
    folder = trainer_config().ray_kwargs.ray_init.runtime_env.env_vars.DAS_PROPOSER_TARGETS
    assert option(arguments, "--proposers") == f"${{DAS_PROPOSER_TARGETS:-{folder}}}"


def test_the_message_size_setting_reaches_the_topic_and_every_client() -> None:
    """DAS_KAFKA_MAX_MESSAGE_BYTES, as the compose file sets it, sizes the topic and the producers and consumers."""
    import os
    import subprocess
    import sys

    probe = (
        "from pipeline.topics import TopicPlan\n"
        "from pipeline.producer import PRODUCER_DEFAULTS\n"
        "from pipeline.consumer import CONSUMER_DEFAULTS\n"
        "configs = TopicPlan(6, 3, 2).configs('t', 'dlq')\n"
        "print(configs['t']['max.message.bytes'], configs['dlq']['max.message.bytes'],"
        " PRODUCER_DEFAULTS['max_request_size'], CONSUMER_DEFAULTS['fetch_max_bytes'])\n"
    )
    size = 8 * 1024 * 1024

    def run(value: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": str(REPO), "DAS_KAFKA_MAX_MESSAGE_BYTES": value}
        return subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600
        )

    result = run(str(size))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(size)] * 4
    refused = run("12k")
    assert refused.returncode != 0 and "DAS_KAFKA_MAX_MESSAGE_BYTES='12k'" in refused.stderr


def test_network_settings_reach_ray_start_and_the_nccl_environment() -> None:
    """scripts/ray_node_env.sh, as both Ray entrypoints source it: set values become `--node-ip-address` and NCCL's
    and Gloo's variables; unset ones are left out (Ray and NCCL choose)."""
    import os
    import subprocess

    probe = (
        f'source {REPO}/scripts/ray_node_env.sh; printf "%s\\n" "${{ray_node_flags[@]}}"; '
        'echo "ifname=${NCCL_SOCKET_IFNAME-unset} gloo=${GLOO_SOCKET_IFNAME-unset} hca=${NCCL_IB_HCA-unset}"'
    )

    def run(**variables: str) -> list[str]:
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("DAS_", "NCCL_", "GLOO_"))
        } | variables
        return subprocess.run(
            ["bash", "-c", probe], env=env, capture_output=True, text=True, check=True
        ).stdout.split()

    assert run(DAS_NODE_IP="10.0.0.11", DAS_NCCL_SOCKET_IFNAME="ib0", DAS_NCCL_IB_HCA="mlx5") == [
        "--node-ip-address=10.0.0.11",
        "ifname=ib0",
        "gloo=ib0",
        "hca=mlx5",
    ]
    assert run(DAS_NODE_IP="", DAS_NCCL_SOCKET_IFNAME="") == ["ifname=unset", "gloo=unset", "hca=unset"]
    # The compose file hands the three settings to both Ray containers.
    for name in ("ray-head", *ray_workers()):
        assert {"DAS_NODE_IP", "DAS_NCCL_SOCKET_IFNAME", "DAS_NCCL_IB_HCA"} <= set(
            environment(SERVICES[name])
        )
    assert _ray_start_params(["--block", "--node-ip-address=10.0.0.11", *command_of(SERVICES["ray-worker"])])


def test_the_infiniband_override_is_valid_compose_and_gives_the_gpu_node_rdma() -> None:
    override = yaml.safe_load((REPO / "docker-compose.infiniband.yml").read_text())
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    jsonschema.Draft7Validator(schema).validate(override)
    assert set(override["services"]) <= set(ray_workers())
    worker = override["services"]["ray-worker"]
    assert "/dev/infiniband:/dev/infiniband" in worker["devices"] and "IPC_LOCK" in worker["cap_add"]


def test_checkpoints_and_history_can_live_on_a_data_disk() -> None:
    env = {**SECRETS, "DAS_CHECKPOINT_DIR": "/mnt/data/ckpt", "DAS_HISTORY_DATA_DIR": "/mnt/data/das"}
    services = interpolate(RAW, env=env)["services"]
    jsonschema.Draft7Validator(json.loads(COMPOSE_SCHEMA.read_text())).validate(interpolate(RAW, env=env))
    for name in ("ray-head", *ray_workers()):
        assert mounts(services[name])["/checkpoints"] == "/mnt/data/ckpt", name
    for name in (*replicas(), *ray_workers()):
        assert mounts(services[name])["/var/lib/das"] == "/mnt/data/das", name
    # By default both are named volumes that the file defines.
    assert mounts(SERVICES["ray-head"])["/checkpoints"] in COMPOSE["volumes"]
    assert mounts(SERVICES["history"])["/var/lib/das"] in COMPOSE["volumes"]


def test_the_trainer_is_tuned_from_compose_and_keeps_few_checkpoints() -> None:
    config = trainer_config()
    assert config.trainer.max_actor_ckpt_to_keep == 2 and config.trainer.max_critic_ckpt_to_keep == 2
    assert config.data.max_response_length == 4096 and config.data.max_prompt_length == 1024
    assert config.data.filter_overlong_prompts is True
    assert config.actor_rollout_ref.rollout.gpu_memory_utilization == 0.6
    assert environment(SERVICES["ray-head"])["DAS_VERL_ARGS"] == ""


def test_constraints_merge_pins_each_package_once_with_the_base_first() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "merge_constraints", REPO / "scripts" / "merge_constraints.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    base = ["torch==2.11.0\n", "Six==1.16.0\n"]
    project = (REPO / "requirements" / "project.txt").read_text().splitlines()
    gpu = (REPO / "requirements" / "gpu-constraints.txt").read_text().splitlines()
    merged = module.merge(base, project, gpu)
    names = [module.package(line) for line in merged]
    assert len(names) == len(set(names))
    assert "six==1.16.0" in [line.lower() for line in merged] and "torch==2.11.0" in merged
    assert "rocksdict==0.3.29" in merged and "TransferQueue==0.1.11" in merged
