"""The pipeline's errors, in one module that the bus, the Kafka producer, the replica's clients and topic
administration all import (so none of them imports another for its errors).

`BusError` and its kinds are what a caller of the bus sees; `workers.cli.main` prints them as one line.
"""

from __future__ import annotations

from dataclasses import dataclass

# Records a publisher may have waiting before `publish` refuses more (BusBackpressureError): at ~10 KB a
# trajectory this is ~100 MB, minutes of rollouts, which rides out a broker restart without holding unbounded
# memory.
DEFAULT_QUEUE_RECORDS = 10_000


class BusError(RuntimeError):
    """The bus cannot take or deliver records (broker unreachable, records refused, bus closed)."""


class InvalidInput(ValueError):
    """A value handed to the pipeline is invalid: a bus URL, a Kafka setting, a topic setting, a control record.
    `das` prints it as one line (a plain ValueError is a bug and keeps its traceback)."""


class BusBackpressureError(BusError):
    """The publish queue stayed full for the bus's bounded wait: the consumer side or the brokers do not keep
    up. The record was not taken."""


class BusUnavailableError(BusError):
    """No broker answered: a transient condition (an outage, a restart); the caller may wait and try again."""


@dataclass(frozen=True, slots=True)
class DeliveryReport:
    """What became of every record a producer took, counted exactly.

    acknowledged: the brokers confirmed them (acks=all). refused: definitely not in the topic (the broker
    refused them, or they could not be encoded). unknown: not confirmed when the report was made; they may or
    may not be in the topic (sent before an outage whose answers never came, or still queued at close).
    """

    published: int
    acknowledged: int
    refused: int
    unknown: int
    first_refusal: str | None = None
    last_error: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "published": self.published,
            "acknowledged": self.acknowledged,
            "refused": self.refused,
            "unknown": self.unknown,
        }

    def __str__(self) -> str:
        text = (
            f"{self.published} records published: {self.acknowledged} acknowledged, {self.refused} refused, "
            f"{self.unknown} unknown (not confirmed; they may or may not be in the topic)"
        )
        if self.first_refusal:
            text += f"; first refusal: {self.first_refusal}"
        if self.unknown and self.last_error:
            text += f"; last error: {self.last_error}"
        return text


class BusDeliveryError(BusError):
    """Some published records are not acknowledged: `report` says exactly how many were refused or unknown."""

    def __init__(self, message: str, report: DeliveryReport) -> None:
        super().__init__(f"{message}: {report}")
        self.report = report
