"""Subcommands of `das`: each module here defines `register(cli: Cli) -> None` and is found automatically."""
