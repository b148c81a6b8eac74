"""``orthrus-sim``: simulate embedding + generation co-serving and compare configurations."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from orthrus_sim.scenario import load_scenario, read_scenario

app = typer.Typer(help="Orthrus discrete-event simulator.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
console = Console()


def _fail(exc: Exception) -> None:
    console.print(f"[red]error:[/red] {exc}")
    raise typer.Exit(2)


@app.command()
def run(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    out: Path = typer.Option(Path("out"), "--out", help="directory for results.json, CSVs, PNGs"),
    set_: list[str] = typer.Option([], "--set", help="override a field: section.key=value (YAML)"),
    workers: int = typer.Option(0, help="parallel processes (0: one per CPU)"),
) -> None:
    """Run every configuration listed in the scenario and compare them."""
    from orthrus_sim.runner import run_scenario

    try:
        load_scenario(scenario, set_)  # validate before starting workers
        run_scenario(read_scenario(scenario), set_, out, workers or None, console)
    except ValueError as exc:
        _fail(exc)


@app.command()
def sweep(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    grid: list[str] = typer.Option(..., "--grid", help="key=v1,v2,... (repeat for a grid)"),
    out: Path = typer.Option(Path("out/sweep"), "--out"),
    set_: list[str] = typer.Option([], "--set", help="override a field: section.key=value"),
    workers: int = typer.Option(0, help="parallel processes (0: one per CPU)"),
) -> None:
    """Run a parameter grid (all configurations at each point) in parallel."""
    from orthrus_sim.runner import run_sweep

    try:
        load_scenario(scenario, set_)
        run_sweep(read_scenario(scenario), set_, grid, out, workers or None, console)
    except ValueError as exc:
        _fail(exc)


@app.command()
def validate(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    set_: list[str] = typer.Option([], "--set", help="override a field: section.key=value"),
) -> None:
    """Check a scenario without running it, and show what each configuration places where."""
    from orthrus_sim.sim.cluster import plan_configuration

    try:
        sc = load_scenario(scenario, set_)
        table = Table(title=f"{sc.name}: placement ({sc.cluster.gpus} x {sc.hardware}, {sc.model})")
        for col in ("configuration", "GPU", "role", "policy", "token budget", "chunk", "KV blocks"):
            table.add_column(col)
        for cfg in sc.configurations:
            for i, plan in enumerate(plan_configuration(sc, cfg)):
                c = plan.config
                table.add_row(cfg if i == 0 else "", str(i), plan.role, plan.policy,
                              str(c.token_budget), str(c.chunk_size), str(c.num_blocks))
        console.print(table)
        console.print(f"[green]{scenario} is valid[/green]")
    except ValueError as exc:
        _fail(exc)


@app.command()
def catalogue() -> None:
    """List the known hardware and models."""
    from orthrus_sim.costmodel import HARDWARE, MODEL_CONFIGS, get_model

    hw = Table(title="hardware", show_lines=False)
    for col in ("name", "bf16 TFLOP/s", "mem GB/s", "memory GB", "link GB/s"):
        hw.add_column(col)
    for h in HARDWARE.values():
        hw.add_row(h.name, f"{h.peak_flops / 1e12:.1f}", f"{h.mem_bw / 1e9:.0f}",
                   f"{h.mem_capacity / 1e9:.0f}", f"{h.interconnect_bw / 1e9:.0f}")
    console.print(hw)
    models = Table(title="models")
    for col in ("name", "params (B)", "layers", "hidden", "heads/kv", "KV KiB/token"):
        models.add_column(col)
    for name in MODEL_CONFIGS:
        m = get_model(name)
        models.add_row(name, f"{m.num_params / 1e9:.2f}", str(m.num_layers), str(m.hidden_size),
                       f"{m.num_heads}/{m.num_kv_heads}", f"{m.kv_bytes_per_token / 1024:.0f}")
    console.print(models)


if __name__ == "__main__":
    app()
