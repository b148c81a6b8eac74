"""Console helpers both command lines share: tables that are never cut, one-line errors."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape


def make_console(stderr: bool = False) -> Console:
    """A console that never cuts a table: wide when the output is a file or a pipe."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=200)


def fail(message: object, code: int = 2) -> None:
    """Print ``error: message`` on stderr (no traceback, no markup read in it) and exit."""
    Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {escape(str(message))}",
                                              highlight=False)
    raise typer.Exit(code)


def interrupted() -> None:
    """Ctrl-C: one line, exit status 130."""
    Console(stderr=True).print("interrupted", highlight=False)
    raise typer.Exit(130)


def version_option(program: str):
    """A ``--version`` option callback that prints ``program VERSION`` and exits."""
    from orthrus_sim import __version__

    def show(value: bool) -> None:
        if value:
            print(f"{program} {__version__}")
            raise typer.Exit()

    return show
