"""`grpo-report RUN_DIR`: plots of a run's metrics and an HTML page with sample completions."""

from __future__ import annotations

from pathlib import Path

import typer

from grpo.cli.common import guard, run_app

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="The run directory (the orchestrator's output_dir)."),
    out: Path | None = typer.Option(
        None, "--out", help="Where the page and plots go (default RUN_DIR/report)."
    ),
    verbose: bool = typer.Option(False, "--verbose", help="Tracebacks for errors."),
) -> None:
    """Write PNG plots (reward per env and per function, KL and masked fractions, tokens/s, step
    time split, completion length) and index.html with them and a few sample completions."""

    def body() -> int:
        from grpo.orchestrator.reporting.run_report import write_report

        print(write_report(run_dir, out))
        return 0

    guard("grpo-report", verbose, body)


def main() -> None:
    run_app(app, "grpo-report")


if __name__ == "__main__":
    main()
