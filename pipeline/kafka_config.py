"""Kafka client configuration: broker addresses and TLS/SASL settings from the bus URL and the environment.

Every Kafka client DAS makes (rollout producer, history replica, dead-letter and tombstone producer, topic
administration, `das kafka dlq`) passes its settings through `client_settings`, so security configured once
reaches all of them. Sources, strongest first:
1. settings passed in code (`open_bus(url, **settings)`, `--kafka-setting key=value`);
2. query parameters of the bus URL: `kafka://h1:9093,h2:9093?security_protocol=SASL_SSL&sasl_mechanism=PLAIN`;
3. environment variables (keep passwords here or in a secret file, not in a URL that shows up in logs):

| variable                      | kafka-python setting  |
|-------------------------------|-----------------------|
| DAS_KAFKA_SECURITY_PROTOCOL   | security_protocol     |
| DAS_KAFKA_SASL_MECHANISM      | sasl_mechanism        |
| DAS_KAFKA_SASL_USERNAME       | sasl_plain_username   |
| DAS_KAFKA_SASL_PASSWORD       | sasl_plain_password   |
| DAS_KAFKA_SSL_CAFILE          | ssl_cafile            |
| DAS_KAFKA_SSL_CERTFILE        | ssl_certfile          |
| DAS_KAFKA_SSL_KEYFILE         | ssl_keyfile           |

kafka-python uses `sasl_plain_username/password` for SCRAM as well as PLAIN.

Epoch advances (`pipeline.epochs`) go out under the trainer's own principal: `control_settings` puts
DAS_KAFKA_CONTROL_SASL_USERNAME and DAS_KAFKA_CONTROL_SASL_PASSWORD in place of the client's login when they are
set (a process that publishes trajectories and advances, such as `das rollout`, holds both logins).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import parse_qsl

from pipeline.errors import InvalidInput

KAFKA_SCHEME = "kafka://"
ENV_SETTINGS = {
    "DAS_KAFKA_SECURITY_PROTOCOL": "security_protocol",
    "DAS_KAFKA_SASL_MECHANISM": "sasl_mechanism",
    "DAS_KAFKA_SASL_USERNAME": "sasl_plain_username",
    "DAS_KAFKA_SASL_PASSWORD": "sasl_plain_password",
    "DAS_KAFKA_SSL_CAFILE": "ssl_cafile",
    "DAS_KAFKA_SSL_CERTFILE": "ssl_certfile",
    "DAS_KAFKA_SSL_KEYFILE": "ssl_keyfile",
}
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
# URL parameters: the security settings, and the client timeouts an operator tunes per deployment.
URL_SETTINGS = frozenset(ENV_SETTINGS.values()) | {
    "ssl_check_hostname",
    "request_timeout_ms",
    "reconnect_backoff_max_ms",
}
_FILE_SETTINGS = ("ssl_cafile", "ssl_certfile", "ssl_keyfile")


@functools.cache
def _known_settings() -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """(every setting some kafka-python client takes, those that are counts, sizes or durations: whole numbers
    >= 0, and those that are flags), from the clients' defaults and their types. A setting of the wrong type
    then fails here, in one line, instead of deep inside a client (or as a 30 s bootstrap timeout)."""
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

    defaults = {
        **KafkaAdminClient.DEFAULT_CONFIG,
        **KafkaConsumer.DEFAULT_CONFIG,
        **KafkaProducer.DEFAULT_CONFIG,
    }
    whole = frozenset(
        k
        for k, v in defaults.items()
        # Some durations default to a float standing for "forever"; acks takes "all" as well as numbers.
        if k != "acks" and (k.endswith(("_ms", "_bytes")) or (isinstance(v, int) and not isinstance(v, bool)))
    )
    return frozenset(defaults), whole, frozenset(k for k, v in defaults.items() if isinstance(v, bool))


# kafka-python reports a refused TLS handshake or SASL login as a bootstrap timeout: say so where it surfaces.
UNREACHABLE = (
    "no broker completed a handshake (wrong address, brokers down, or they refuse this client's TLS/SASL "
    "settings, e.g. a wrong password)"
)


CONTROL_ENV_SETTINGS = {
    "DAS_KAFKA_CONTROL_SASL_USERNAME": "sasl_plain_username",
    "DAS_KAFKA_CONTROL_SASL_PASSWORD": "sasl_plain_password",
}


def control_settings(
    settings: Mapping[str, object], environ: Mapping[str, str] | None = None
) -> dict[str, object]:
    """`settings` with the trainer's login (DAS_KAFKA_CONTROL_SASL_USERNAME/PASSWORD) in place of the client's
    when those variables are set: what epoch advances are sent with."""
    env = os.environ if environ is None else environ
    login = {setting: env[name] for name, setting in CONTROL_ENV_SETTINGS.items() if env.get(name)}
    return {**settings, **login}


def parse_bus_url(url: str) -> tuple[list[str], dict[str, object]]:
    """(["host:port", ...], settings) from "kafka://host:port[,host:port][?key=value&...]".

    Raises ValueError on a malformed URL or an unknown parameter.
    """
    if not url.startswith(KAFKA_SCHEME):
        raise InvalidInput(f"not a Kafka bus URL (expected kafka://host:port[,host:port]): {url!r}")
    hosts, _, query = url[len(KAFKA_SCHEME) :].partition("?")
    servers = [s.strip() for s in hosts.split(",") if s.strip()]
    for server in servers:
        host, sep, port = server.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise InvalidInput(f"bad broker address {server!r} in bus URL: expected host:port (port 1-65535)")
    if not servers:
        raise InvalidInput("no broker in the bus URL: expected kafka://host:port[,host:port]")
    settings: dict[str, object] = {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key not in URL_SETTINGS:
            raise InvalidInput(f"unknown bus URL parameter {key!r}; known: {', '.join(sorted(URL_SETTINGS))}")
        settings[key] = _typed(value)
    return servers, settings


def _typed(raw: str) -> object:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    if raw.isdigit():
        return int(raw)
    return raw


def settings_from_env(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """The DAS_KAFKA_* variables that are set (and not empty), as kafka-python settings."""
    env = os.environ if environ is None else environ
    return {setting: env[name] for name, setting in ENV_SETTINGS.items() if env.get(name)}


# Settings DAS sets itself on every client: the brokers come from the bus URL, the group and client ids from the
# replica's name, the serializers and offset handling from the wire format and the store. Passing one fails at once.
RESERVED_SETTINGS = {
    "bootstrap_servers": "the brokers come from the bus URL (--bus kafka://host:port,...)",
    "group_id": "a replica's consumer group is its name (--replica)",
    "client_id": "DAS names its clients after their role and replica",
    "key_serializer": "DAS sends bytes in its own wire format",
    "value_serializer": "DAS sends bytes in its own wire format",
    "key_deserializer": "DAS reads bytes in its own wire format",
    "value_deserializer": "DAS reads bytes in its own wire format (and bounds what one poll takes)",
    "enable_auto_commit": "a replica's offsets live in its store and are copied to Kafka after each write",
}
# Largest count, size or duration a setting may take: Kafka's protocol holds them in 32-bit fields.
MAX_SETTING = 2**31 - 1
_ZERO_ALLOWED = frozenset({"consumer_timeout_ms", "max_block_ms"})


def _positive(key: str) -> bool:
    """Settings for which 0 is no value at all (a timeout of 0 fails every request at once)."""
    return key not in _ZERO_ALLOWED and key.endswith(
        ("_timeout_ms", "_interval_ms", "max_request_size", "fetch_max_bytes")
    )


def client_settings(settings: Mapping[str, object]) -> dict[str, object]:
    """`settings` over the environment's security settings, checked.

    Raises ValueError for a setting DAS sets itself (`RESERVED_SETTINGS`), one no kafka-python client knows, a
    count, size or duration that is not a whole number from 0 (1 for timeouts, intervals and request sizes) to
    2**31-1, a flag that is not true or false, an unknown protocol or mechanism, SASL without a user name
    and password, or a TLS file that does not exist (the client would otherwise fail later with a vague
    handshake error).
    """
    merged = {**settings_from_env(), **settings}
    known, whole, flags = _known_settings()
    for key, value in merged.items():
        if key in RESERVED_SETTINGS:
            raise InvalidInput(f"Kafka setting {key} is not yours to set: {RESERVED_SETTINGS[key]}")
        if key not in known:
            raise InvalidInput(
                f"unknown Kafka client setting {key!r} (kafka-python names, e.g. request_timeout_ms)"
            )
        low = 1 if _positive(key) else 0
        if key in whole and (
            isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_SETTING
        ):
            raise InvalidInput(
                f"Kafka setting {key} must be a whole number from {low} to {MAX_SETTING}, got {value!r}"
            )
        if key in flags and not isinstance(value, bool):
            raise InvalidInput(f"Kafka setting {key} must be true or false, got {value!r}")
    protocol = str(merged.get("security_protocol", "PLAINTEXT")).upper()
    if protocol not in SECURITY_PROTOCOLS:
        raise InvalidInput(
            f"unknown Kafka security protocol {protocol!r}; use one of {', '.join(SECURITY_PROTOCOLS)}"
        )
    if "security_protocol" in merged:
        merged["security_protocol"] = protocol
    if protocol.startswith("SASL_"):
        mechanism = str(merged.get("sasl_mechanism", "PLAIN")).upper()
        if mechanism not in SASL_MECHANISMS:
            raise InvalidInput(
                f"unknown SASL mechanism {mechanism!r}; use one of {', '.join(SASL_MECHANISMS)}"
            )
        merged["sasl_mechanism"] = mechanism
        missing = [s for s in ("sasl_plain_username", "sasl_plain_password") if not merged.get(s)]
        if missing:
            raise InvalidInput(
                f"security protocol {protocol} needs a user name and password: set DAS_KAFKA_SASL_USERNAME "
                f"and DAS_KAFKA_SASL_PASSWORD (missing: {', '.join(missing)})"
            )
    for setting in _FILE_SETTINGS:
        path = merged.get(setting)
        if path is not None and not Path(str(path)).is_file():
            raise InvalidInput(f"Kafka {setting} {path!r} is not a readable file")
    return merged
