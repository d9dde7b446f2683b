"""Command-line entry points. Only typer, pydantic and yaml are imported before arguments are
parsed; torch and vLLM load inside the commands, so `--help` answers at once."""
