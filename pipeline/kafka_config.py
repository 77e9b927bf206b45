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
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import parse_qsl

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


def parse_bus_url(url: str) -> tuple[list[str], dict[str, object]]:
    """(["host:port", ...], settings) from "kafka://host:port[,host:port][?key=value&...]".

    Raises ValueError on a malformed URL or an unknown parameter.
    """
    if not url.startswith(KAFKA_SCHEME):
        raise ValueError(f"not a Kafka bus URL (expected kafka://host:port[,host:port]): {url!r}")
    hosts, _, query = url[len(KAFKA_SCHEME) :].partition("?")
    servers = [s.strip() for s in hosts.split(",") if s.strip()]
    for server in servers:
        host, sep, port = server.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"bad broker address {server!r} in bus URL: expected host:port (port 1-65535)")
    if not servers:
        raise ValueError("no broker in the bus URL: expected kafka://host:port[,host:port]")
    settings: dict[str, object] = {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key not in URL_SETTINGS:
            raise ValueError(f"unknown bus URL parameter {key!r}; known: {', '.join(sorted(URL_SETTINGS))}")
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


def client_settings(settings: Mapping[str, object]) -> dict[str, object]:
    """`settings` over the environment's security settings, checked.

    Raises ValueError for a setting no kafka-python client knows, a count, size or duration that is not a whole
    number >= 0, a flag that is not true or false, an unknown protocol or mechanism, SASL without a user name
    and password, or a TLS file that does not exist (the client would otherwise fail later with a vague
    handshake error).
    """
    merged = {**settings_from_env(), **settings}
    known, whole, flags = _known_settings()
    for key, value in merged.items():
        if key not in known:
            raise ValueError(
                f"unknown Kafka client setting {key!r} (kafka-python names, e.g. request_timeout_ms)"
            )
        if key in whole and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"Kafka setting {key} must be a whole number >= 0, got {value!r}")
        if key in flags and not isinstance(value, bool):
            raise ValueError(f"Kafka setting {key} must be true or false, got {value!r}")
    protocol = str(merged.get("security_protocol", "PLAINTEXT")).upper()
    if protocol not in SECURITY_PROTOCOLS:
        raise ValueError(
            f"unknown Kafka security protocol {protocol!r}; use one of {', '.join(SECURITY_PROTOCOLS)}"
        )
    if "security_protocol" in merged:
        merged["security_protocol"] = protocol
    if protocol.startswith("SASL_"):
        mechanism = str(merged.get("sasl_mechanism", "PLAIN")).upper()
        if mechanism not in SASL_MECHANISMS:
            raise ValueError(f"unknown SASL mechanism {mechanism!r}; use one of {', '.join(SASL_MECHANISMS)}")
        merged["sasl_mechanism"] = mechanism
        missing = [s for s in ("sasl_plain_username", "sasl_plain_password") if not merged.get(s)]
        if missing:
            raise ValueError(
                f"security protocol {protocol} needs a user name and password: set DAS_KAFKA_SASL_USERNAME "
                f"and DAS_KAFKA_SASL_PASSWORD (missing: {', '.join(missing)})"
            )
    for setting in _FILE_SETTINGS:
        path = merged.get(setting)
        if path is not None and not Path(str(path)).is_file():
            raise ValueError(f"Kafka {setting} {path!r} is not a readable file")
    return merged
