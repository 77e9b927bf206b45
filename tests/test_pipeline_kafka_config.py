"""Kafka security settings reach every client from one place: bus URL parameters, DAS_KAFKA_* variables and
explicit settings, strongest last, checked before any connection is tried."""

from __future__ import annotations

import pytest

from pipeline.kafka_config import client_settings, parse_bus_url


def test_bus_url_parameters_become_client_settings():
    servers, settings = parse_bus_url(
        "kafka://b1:9093,b2:9093?security_protocol=SASL_SSL&sasl_mechanism=SCRAM-SHA-512&ssl_check_hostname=false"
    )
    assert servers == ["b1:9093", "b2:9093"]
    assert settings == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "ssl_check_hostname": False,
    }


@pytest.mark.parametrize(
    "url, message",
    [
        ("kafka://b1:9093?acks=0", "unknown bus URL parameter 'acks'"),
        ("kafka://b1:70000", "port 1-65535"),
        ("kafka://", "no broker"),
        ("redis://b1:1", "not a Kafka bus URL"),
    ],
)
def test_malformed_bus_urls_are_refused_with_the_reason(url, message):
    with pytest.raises(ValueError, match=message):
        parse_bus_url(url)


def test_environment_supplies_security_and_explicit_settings_win(monkeypatch, tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv("DAS_KAFKA_SECURITY_PROTOCOL", "sasl_ssl")
    monkeypatch.setenv("DAS_KAFKA_SASL_MECHANISM", "PLAIN")
    monkeypatch.setenv("DAS_KAFKA_SASL_USERNAME", "das")
    monkeypatch.setenv("DAS_KAFKA_SASL_PASSWORD", "secret")
    monkeypatch.setenv("DAS_KAFKA_SSL_CAFILE", str(ca))
    settings = client_settings({"sasl_mechanism": "SCRAM-SHA-256"})
    assert settings == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_plain_username": "das",
        "sasl_plain_password": "secret",
        "ssl_cafile": str(ca),
    }


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"security_protocol": "TLS"}, "unknown Kafka security protocol"),
        ({"security_protocol": "SASL_PLAINTEXT", "sasl_plain_username": "u"}, "sasl_plain_password"),
        (
            {"security_protocol": "SASL_SSL", "sasl_mechanism": "GSSAPI", "sasl_plain_username": "u"},
            "unknown SASL mechanism",
        ),
        ({"security_protocol": "SSL", "ssl_cafile": "/nonexistent/ca.pem"}, "not a readable file"),
    ],
)
def test_incomplete_security_settings_fail_before_connecting(monkeypatch, settings, message):
    for name in ("DAS_KAFKA_SASL_USERNAME", "DAS_KAFKA_SASL_PASSWORD", "DAS_KAFKA_SECURITY_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=message):
        client_settings(settings)
