"""The `das` command. Subcommands live in `workers.cli.commands`, one module per area, discovered at start.

Errors reach the user in one place, `main`, always as one line `das <command>: <message>`: a bad flag or
variable is refused by the parser, and a command raises `UsageError` for arguments only it can check (exit 2);
the parts' own errors (StoreError, BusError, each part's InvalidInput for settings, files and data that do not
hold, a pydantic ValidationError of a schema or a config) and OSError are failures (exit 1). Anything else, a
plain ValueError included, is a bug and keeps its traceback. Commands never print their own errors. `--debug`
shows the traceback of any.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from pydantic import ValidationError

from history_store.errors import InvalidInput as InvalidHistoryInput
from history_store.errors import StoreError
from pipeline.errors import BusError
from pipeline.errors import InvalidInput as InvalidPipelineInput
from workers.cli import commands
from workers.cli.types import UsageError
from workers.errors import InvalidInput

# What a command may raise for a user to read; anything else is a bug and keeps its traceback.
USER_ERRORS = (
    StoreError,
    BusError,
    InvalidInput,
    InvalidHistoryInput,
    InvalidPipelineInput,
    ValidationError,
    OSError,
)


class DasArgumentParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the usage is one `--help` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {one_line(message)} (see `{self.prog} --help`)\n")


class Cli:
    """Builds nested subcommands (`das bench tree`, `das history stats`) from several modules."""

    def __init__(self) -> None:
        self.parser = DasArgumentParser(prog="das", description=__doc__)
        self.parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
        self._groups: dict[tuple[str, ...], argparse._SubParsersAction] = {
            (): self.parser.add_subparsers(dest="command", required=True)
        }

    def _group(self, path: tuple[str, ...]) -> argparse._SubParsersAction:
        if path not in self._groups:
            parent = self._group(path[:-1])
            parser = parent.add_parser(path[-1], help=f"{' '.join(path)} commands")
            self._groups[path] = parser.add_subparsers(dest="_".join(path) + "_command", required=True)
        return self._groups[path]

    def command(
        self, *path: str, help: str, run: Callable[[argparse.Namespace], int | None]
    ) -> argparse.ArgumentParser:
        """Adds `das <path...>`; `run(args)` is called with the parsed arguments and returns an exit code."""
        parser = self._group(tuple(path[:-1])).add_parser(path[-1], help=help, description=help)
        parser.set_defaults(_run=run, _prog=parser.prog)
        return parser


def build_cli() -> Cli:
    cli = Cli()
    for module in sorted(m.name for m in pkgutil.iter_modules(commands.__path__)):
        importlib.import_module(f"{commands.__name__}.{module}").register(cli)
    return cli


def one_line(message: str) -> str:
    """A message folded onto one line (Kafka and RocksDB errors can span several)."""
    return "; ".join(line.strip() for line in str(message).splitlines() if line.strip())


def describe(exc: BaseException) -> str:
    """What happened, for a user: OSErrors without their `[Errno N]` prefix but with the file concerned."""
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
        if exc.filename is not None:
            text += f": {exc.filename}"
        return one_line(text)
    return one_line(str(exc)) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    args = build_cli().parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except UsageError as exc:
        if args.debug:
            raise
        print(f"{args._prog}: {describe(exc)} (see `{args._prog} --help`)", file=sys.stderr)
        return 2
    except USER_ERRORS as exc:
        if args.debug:
            raise
        print(f"{args._prog}: {describe(exc)}", file=sys.stderr)
        return 1
