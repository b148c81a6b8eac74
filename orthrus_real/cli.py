"""``orthrus-real``: run the shared scheduler on real hardware."""

from __future__ import annotations

from pathlib import Path

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


@app.command("init-model")
def init_model_cmd(
    out_dir: Path = typer.Argument(..., help="directory to write the model into"),
    family: str = typer.Option("llama", help="llama | mistral | qwen2"),
    size: str = typer.Option("tiny", help="tiny (tests) | small (CPU benchmark, ~100 M, bf16)"),
    seed: int = typer.Option(0),
    dtype: str = typer.Option(None, help="float32 | bfloat16 (default: the size's)"),
    shards: int = typer.Option(1, help="split the weights into this many safetensors files"),
    adapter_rank: int = typer.Option(0, help="also write a PEFT LoRA adapter of this rank to DIR/adapter"),
) -> None:
    """Write a seeded random model (config.json, safetensors, tokenizer.json) in HF layout."""
    from orthrus_real.init_model import init_model

    try:
        path = init_model(out_dir, family, size, seed, dtype, shards, adapter_rank or None)
    except ValueError as exc:
        Console().print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    Console().print(f"wrote {family}/{size} model to {path}"
                    + (f" with a rank-{adapter_rank} adapter in {path / 'adapter'}" if adapter_rank else ""))


if __name__ == "__main__":
    app()
