"""Argument types of every `das` flag and environment variable: the one place where numbers are checked; and the
argument groups (with their output) that several commands share, so each reads and behaves the same everywhere.

A flag declares its range with `integer(...)`, `number(...)` or `PORT`; argparse then refuses a bad value with
one line and exit code 2 before the command touches anything. Environment variables used as defaults go
through the same types via `from_env`, and are only checked by the subcommand that reads them, so a bad
`DAS_METRICS_PORT` never breaks `das --help` or an unrelated command.

Every checked type also offers `invalid_examples()`: the table-driven CLI test feeds them to every flag, so a
flag added later is covered without editing the test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from monitoring.server import DEFAULT_HOST, HOST_ENV, PORT_ENV
from workers.errors import InvalidInput

NO_METRICS_SERVER = -1


class UsageError(ValueError):
    """Arguments the parser cannot check alone (a combination of flags, a missing file they name): `das` prints
    it like a parser error, as one line, with exit code 2."""


class EnvValue(str):
    """A default read from an environment variable; errors about it name the variable."""

    variable: str

    def __new__(cls, value: str, variable: str) -> EnvValue:
        instance = super().__new__(cls, value)
        instance.variable = variable
        return instance


# Every variable read through `from_env`, for the table-driven CLI test.
ENV_VARIABLES: set[str] = set()


def from_env(variable: str, fallback: object) -> object:
    """The variable's raw text as a default (checked by the flag's type when the flag is not given), else
    `fallback` unchanged."""
    ENV_VARIABLES.add(variable)
    raw = os.environ.get(variable)
    return fallback if raw is None else EnvValue(raw, variable)


def _shown(raw: str) -> str:
    if isinstance(raw, EnvValue):
        return f"${raw.variable}={str(raw)!r}"
    return repr(str(raw))


class _Checked:
    """Base of the checked types: parses, checks the range, and says what it expected."""

    expected: str

    def __call__(self, raw: str) -> int | float:
        value = self._parse(raw.strip())
        if value is None or not self._in_range(value):
            raise argparse.ArgumentTypeError(f"expected {self.expected}, got {_shown(raw)}")
        return value

    def _parse(self, raw: str) -> int | float | None:
        raise NotImplementedError

    def _in_range(self, value: int | float) -> bool:
        raise NotImplementedError

    def invalid_examples(self) -> list[str]:
        raise NotImplementedError

    def valid_example(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.expected


class integer(_Checked):  # noqa: N801 (used like the builtin `int` it replaces)
    """An integer in [minimum, maximum] (either bound optional)."""

    def __init__(self, minimum: int | None = None, maximum: int | None = None) -> None:
        self.minimum, self.maximum = minimum, maximum
        if minimum is not None and maximum is not None:
            self.expected = f"an integer from {minimum} to {maximum}"
        elif minimum is not None:
            self.expected = f"an integer >= {minimum}"
        elif maximum is not None:
            self.expected = f"an integer <= {maximum}"
        else:
            self.expected = "an integer"

    def _parse(self, raw: str) -> int | None:
        try:
            return int(raw, 10)
        except ValueError:
            return None

    def _in_range(self, value: int | float) -> bool:
        return (self.minimum is None or value >= self.minimum) and (
            self.maximum is None or value <= self.maximum
        )

    def invalid_examples(self) -> list[str]:
        out = ["abc", "1.5", ""]
        if self.minimum is not None:
            out.append(str(self.minimum - 1))
        if self.maximum is not None:
            out.append(str(self.maximum + 1))
        return out

    def valid_example(self) -> str:
        return str(self.minimum if self.minimum is not None else 0 if self.maximum is None else self.maximum)


# Every number flag has an upper bound: without one, 1e308 passes the parser and overflows later (a sleep, a timeout
# in milliseconds, a thread's wait) with a traceback, or leaves a thread dead. No count, cost or rate DAS takes
# comes near this; durations have their own, lower bound (DURATION_CEILING).
NUMBER_CEILING = 1e12
# Seconds (about 11.6 days): far below threading's TIMEOUT_MAX and 2**31-1 milliseconds.
DURATION_CEILING = 1e6


class number(_Checked):  # noqa: N801 (used like the builtin `float` it replaces)
    """A finite real number in [minimum, maximum]; `above` makes the lower bound exclusive (durations, rates).
    Without a `maximum`, NUMBER_CEILING is the bound."""

    def __init__(
        self, minimum: float | None = None, maximum: float | None = None, *, above: float | None = None
    ) -> None:
        if minimum is not None and above is not None:
            raise ValueError("give minimum or above, not both")
        maximum = NUMBER_CEILING if maximum is None else maximum
        self.minimum, self.maximum, self.above = minimum, maximum, above
        parts = []
        if above is not None:
            parts.append(f"> {above:g}")
        if minimum is not None:
            parts.append(f">= {minimum:g}")
        if maximum is not None:
            parts.append(f"<= {maximum:g}")
        self.expected = "a finite number" + (f" {' and '.join(parts)}" if parts else "")

    def _parse(self, raw: str) -> float | None:
        try:
            value = float(raw)
        except ValueError:
            return None
        return value if math.isfinite(value) else None

    def _in_range(self, value: int | float) -> bool:
        return (
            (self.minimum is None or value >= self.minimum)
            and (self.above is None or value > self.above)
            and (self.maximum is None or value <= self.maximum)
        )

    def invalid_examples(self) -> list[str]:
        out = ["abc", "nan", "inf", ""]
        if self.minimum is not None:
            out.append(f"{self.minimum - 1:g}")
        if self.above is not None:
            out.append(f"{self.above:g}")
        out.append(f"{self.maximum * 2 if self.maximum > 0 else self.maximum + 1:g}")
        out.append("1e308")
        return out

    def valid_example(self) -> str:
        if self.minimum is not None:
            return f"{self.minimum:g}"
        if self.above is not None:
            return f"{self.above + 1:g}"
        return f"{self.maximum:g}" if self.maximum is not None else "0"


class rate(number):  # noqa: N801 (a checked type, like `number`)
    """Events per second: 0 (as fast as possible), or from `slowest` to `fastest` (a positive rate so small
    that its interval overflows a sleep is no rate)."""

    def __init__(self, slowest: float, fastest: float) -> None:
        super().__init__(0, fastest)
        self.slowest = slowest
        self.expected = f"0 (as fast as possible) or a number from {slowest:g} to {fastest:g}"

    def _in_range(self, value: int | float) -> bool:
        return value == 0 or self.slowest <= value <= self.maximum

    def invalid_examples(self) -> list[str]:
        return ["abc", "nan", "inf", "", "-1", f"{self.maximum * 2:g}", f"{self.slowest / 2:g}", "1e-300"]


POSITIVE = integer(1)
NON_NEGATIVE = integer(0)
SECONDS = number(above=0, maximum=DURATION_CEILING)
# A wait that may be 0 (a timeout: 0 gives up at once).
TIMEOUT = number(0, DURATION_CEILING)
RATE = rate(0.001, 1e6)
PORT = integer(1, 65535)
# -1 serves nothing, 0 asks the OS for a free port.
METRICS_PORT = integer(NO_METRICS_SERVER, 65535)


def add_metrics_arguments(parser: argparse.ArgumentParser, default_port: int = NO_METRICS_SERVER) -> None:
    """Adds `--metrics-host` and `--metrics-port` (defaults from DAS_METRICS_HOST / DAS_METRICS_PORT, checked
    only when this command runs)."""
    parser.add_argument(
        "--metrics-host",
        default=os.environ.get(HOST_ENV, DEFAULT_HOST),
        help=f"address to serve /metrics on (env {HOST_ENV}; default {DEFAULT_HOST}, loopback only)",
    )
    parser.add_argument(
        "--metrics-port",
        type=METRICS_PORT,
        default=from_env(PORT_ENV, default_port),
        help=f"port to serve /metrics on (env {PORT_ENV}; default {default_port}); -1 serves nothing, "
        "0 picks a free port",
    )


def temperature_schedule(raw: str) -> tuple[float, ...]:
    """Comma-separated sampling temperatures, one per epoch, each >= 0 (`--temperatures`)."""
    try:
        values = tuple(float(part) for part in raw.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {raw!r}") from None
    if any(not value >= 0 for value in values):
        raise argparse.ArgumentTypeError(f"temperatures must be >= 0, got {raw!r}")
    return values


def size_list(what: str, example: str) -> Callable[[str], tuple[int, ...]]:
    """A flag type: comma-separated positive integers (batch sizes, query lengths); errors name `what` and show
    `example`."""

    def parse(raw: str) -> tuple[int, ...]:
        try:
            sizes = tuple(int(part) for part in raw.split(","))
        except ValueError:
            sizes = ()
        if not sizes or min(sizes) < 1:
            raise argparse.ArgumentTypeError(f"{what} must be positive integers like {example}, got {raw!r}")
        return sizes

    return parse


def epoch_temperatures(
    epochs: Sequence[int], temperature: float, temperatures: Sequence[float] | None
) -> dict[int, float]:
    """A trace's sampling temperature per epoch: `--temperatures` (one per epoch, in epoch order) or
    `--temperature` for every epoch.

    Raises:
        ValueError: `--temperatures` does not give one value per epoch.
    """
    ordered = sorted(epochs)
    if temperatures is None:
        return dict.fromkeys(ordered, temperature)
    if len(temperatures) != len(ordered):
        raise InvalidInput(f"--temperatures gives {len(temperatures)} values for {len(ordered)} epochs")
    return dict(zip(ordered, temperatures, strict=True))


# The flags below recur in the `das traces` and `das bench` commands that read a trace, a model folder or both.
JSON_HELP = "print one JSON object"
TRACE_MODEL_HELP = "the checkpoint that sampled the trace (default: das model prepare's folder)"


def add_json_flag(parser: argparse.ArgumentParser, help: str = JSON_HELP) -> None:
    """Adds `--json`: the command prints its result as JSON (see `print_result`) instead of text."""
    parser.add_argument("--json", action="store_true", help=help)


def add_model_dir_argument(parser: argparse.ArgumentParser, help: str = TRACE_MODEL_HELP) -> None:
    """Adds `--model-dir` (a checkpoint folder; None means das model prepare's, see `require_model`)."""
    parser.add_argument("--model-dir", type=Path, help=help)


def add_temperature_arguments(
    parser: argparse.ArgumentParser,
    help: str = "the trace's sampling temperature",
    schedule_help: str = "one temperature per epoch of the trace, comma-separated",
) -> None:
    """Adds `--temperature` and `--temperatures` (one per epoch, replacing it); `epoch_temperatures` reads them."""
    parser.add_argument("--temperature", type=number(0), default=1.0, help=help)
    parser.add_argument(
        "--temperatures", type=temperature_schedule, help=f"{schedule_help}; replaces --temperature"
    )


def add_trace_out_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """Adds the required `-o/--out` of a command that writes a trace (JSON Lines, gzip if .gz)."""
    parser.add_argument("-o", "--out", type=Path, required=True, help=help)


def print_result(
    args: argparse.Namespace,
    result: dict[str, Any],
    text: Callable[[dict[str, Any]], str],
    indent: int | None = None,
) -> int:
    """Prints `result` as JSON with `--json`, else `text(result)`; the command's exit code (0)."""
    print(json.dumps(result, indent=indent) if args.json else text(result))
    return 0
