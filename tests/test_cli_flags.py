"""Every flag and variable of every `das` subcommand is checked in one place (workers/cli/types.py), and every
error reaches the user as one line.

The subcommands and flags come from the real parser, so a flag added later is covered without editing this
file: a numeric flag must use a checked type, and each checked type's bad values must end in exit code 2 with
one line on stderr, before the command touches anything (a real store passed as --data is left unchanged).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from conftest import REPO

from history_store.durable.store import HistoryStore
from pipeline.synthetic import SyntheticShape, synthetic_records
from workers.cli import build_cli, main
from workers.cli import types as cli_types


def _subcommands() -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    def walk(parser: argparse.ArgumentParser, path: list[str]):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, [*path, name])
                return
        yield path, parser

    yield from walk(build_cli().parser, [])


def _checked(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if isinstance(a.type, cli_types._Checked)]


def _filler(parser: argparse.ArgumentParser, skip: argparse.Action, store: str) -> list[str]:
    """Arguments the command requires (positionals, required options), valid, so only the bad value errs."""
    args: list[str] = []
    for action in parser._actions:
        if action is skip or isinstance(action, argparse._HelpAction):
            continue
        value = action.type.valid_example() if isinstance(action.type, cli_types._Checked) else store
        if action.choices:
            value = str(next(iter(action.choices)))
        if not action.option_strings:
            args.append(value)
        elif action.required:
            args.append(f"{action.option_strings[0]}={value}")
        elif action.dest == "data":
            args.append(f"--data={store}")
    return args


CASES = [
    (path, action.option_strings[0], bad)
    for path, parser in _subcommands()
    for action in _checked(parser)
    for bad in action.type.invalid_examples()
]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("cli") / "store"
    with HistoryStore(path) as opened:
        opened.apply(list(synthetic_records(0, 20, SyntheticShape(problems=2, epochs=2))))
    before = {f.name: (f.stat().st_size, f.stat().st_mtime_ns) for f in path.iterdir()}
    yield str(path)
    after = {f.name: (f.stat().st_size, f.stat().st_mtime_ns) for f in path.iterdir()}
    assert after == before, "a refused command touched the store"


def test_no_numeric_flag_escapes_the_checked_types():
    raw = [
        f"das {' '.join(path)} {a.option_strings[0]}"
        for path, parser in _subcommands()
        for a in parser._actions
        if a.type in (int, float)
    ]
    assert not raw, f"use workers.cli.types (integer/number/PORT...) for: {raw}"
    assert len(CASES) > 100


@pytest.mark.parametrize(
    ("path", "flag", "bad"), CASES, ids=[f"{' '.join(p)} {f}={b!r}" for p, f, b in CASES]
)
def test_a_bad_value_of_any_numeric_flag_is_one_line_and_exit_2(path, flag, bad, store, capsys):
    parser = dict((tuple(p), sub) for p, sub in _subcommands())[tuple(path)]
    action = next(a for a in parser._actions if flag in a.option_strings)
    with pytest.raises(SystemExit) as exit_info:
        main([*path, f"{flag}={bad}", *_filler(parser, action, store)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"das {' '.join(path)}: argument {flag}") and "expected" in err, err


def test_a_bad_environment_variable_breaks_only_the_commands_that_read_it(store, monkeypatch, capsys):
    build_cli()  # registers the variables the parser reads through from_env
    assert cli_types.ENV_VARIABLES, "no variable is read through cli_types.from_env"
    for variable in sorted(cli_types.ENV_VARIABLES):
        monkeypatch.setenv(variable, "abc")
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    capsys.readouterr()
    for path, parser in _subcommands():
        env_flags = [a for a in _checked(parser) if isinstance(a.default, cli_types.EnvValue)]
        for action in env_flags:
            with pytest.raises(SystemExit) as exit_info:
                main([*path, *_filler(parser, action, store)])
            assert exit_info.value.code == 2
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and f"${action.default.variable}='abc'" in err, err


def test_run_time_errors_are_one_line_with_exit_1_and_debug_shows_the_traceback(store, capsys):
    for argv, message in [
        (["indexer", "run", "--data", store, "--bus", "kafka://host:abc"], "bad broker address"),
        (["indexer", "run", "--data", store, "--bus", "kafka://h:1?acks=0"], "unknown bus URL parameter"),
        (["history", "stats", "--data", store + "-missing"], "is not a history store"),
        (["history", "restore", store, store], "is neither a checkpoint"),
    ]:
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert (
            len(err.splitlines()) == 1 and err.startswith(f"das {argv[0]} {argv[1]}: ") and message in err
        ), err
    with pytest.raises(ValueError, match="bad broker address"):
        main(["--debug", "indexer", "run", "--data", store, "--bus", "kafka://host:abc"])


def test_a_metrics_port_in_use_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "DAS_BUS": "kafka://127.0.0.1:1"}
        done = subprocess.run(
            [sys.executable, "-m", "workers.cli", "indexer", "run", "--data", str(tmp_path / "s"),
             "--metrics-port", str(port)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 1
    assert (
        done.stderr.strip()
        == f"das indexer run: cannot serve /metrics on 127.0.0.1:{port}: Address already in use"
    )
    assert not (tmp_path / "s").exists()
