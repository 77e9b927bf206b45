"""The `das` command. Subcommands live in `workers.commands`, one module per area, discovered at start."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Callable, Sequence

from workers import commands


class Cli:
    """Builds nested subcommands (`das bench tree`, `das history stats`) from several modules."""

    def __init__(self) -> None:
        self.parser = argparse.ArgumentParser(prog="das", description=__doc__)
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
        parser.set_defaults(_run=run)
        return parser


def build_cli() -> Cli:
    cli = Cli()
    for module in sorted(m.name for m in pkgutil.iter_modules(commands.__path__)):
        importlib.import_module(f"{commands.__name__}.{module}").register(cli)
    return cli


def main(argv: Sequence[str] | None = None) -> int:
    args = build_cli().parser.parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
