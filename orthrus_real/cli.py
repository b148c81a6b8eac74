"""``orthrus-real``: run the shared scheduler on real hardware."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from orthrus_sim.engine import POLICIES

app = typer.Typer(help="Orthrus real executors.", no_args_is_help=True)


@app.command()
def policies() -> None:
    """List the built-in scheduling policies (the names --policy accepts)."""
    table = Table("name", "serves", "what it does")
    for name, cls in POLICIES.items():
        serves = ", ".join(k.value for k in cls.serves)
        table.add_row(name, serves, (cls.__doc__ or "").strip().split("\n")[0])
    Console().print(table)


if __name__ == "__main__":
    app()
