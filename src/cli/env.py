"""`grpo-env ENV_ID`: serve one environment over HTTP for orchestrators whose env[].address points here."""

from __future__ import annotations

import json
import signal
import socket
from typing import Any

import typer

from grpo.cli.common import guard, run_app
from grpo.utils.errors import UserError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


def parse_args_json(text: str) -> dict[str, Any]:
    """--args: a JSON object of keyword arguments for the environment's loader."""
    try:
        args = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"--args is not valid JSON ({exc}); write it like '{{\"num_examples\": 100}}'"
        ) from exc
    if not isinstance(args, dict):
        raise UserError(f"--args must be a JSON object of keyword arguments, got {type(args).__name__}")
    return args


def check_bind(host: str, token_env: str) -> str | None:
    """The token in `$token_env`; refuses a non-loopback bind without one (anyone who reaches
    the port could otherwise reset, step and score, or flood the server)."""
    from grpo.utils.auth import is_loopback_host, secret_from_env

    token = secret_from_env(token_env)
    if token is None and not is_loopback_host(host):
        raise UserError(
            f"--host {host} serves other machines, so clients must authenticate: export {token_env}=<a long "
            f"random string> here and GRPO_ENV_TOKEN=<the same> for the orchestrator, or bind --host 127.0.0.1"
        )
    return None if token is None else token.decode()


@app.command()
def env(
    env_id: str = typer.Argument(..., help="Environment id, as env[].id in orch.yaml."),
    args: str = typer.Option("{}", "--args", help="JSON object of keyword arguments for the loader."),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address (0.0.0.0 serves every interface)."),
    port: int = typer.Option(8100, "--port", help="Port (0 picks a free one; the log line says which)."),
    max_sessions: int = typer.Option(10_000, "--max-sessions", help="Open rollouts kept before evicting."),
    max_sessions_per_client: int = typer.Option(
        4096,
        "--max-sessions-per-client",
        help="Open rollouts kept per client: its token when the server has one, else its host "
        "(its own oldest go first).",
    ),
    max_body_mb: float = typer.Option(16.0, "--max-body-mb", help="Largest request body accepted (MiB)."),
    max_example_kb: float = typer.Option(
        64.0,
        "--max-example-kb",
        help="Largest example (its JSON, KiB) a client may send that is not one of the environment's own; "
        "larger ones are refused (413) before any session stores them.",
    ),
    token_env: str = typer.Option(
        "GRPO_ENV_TOKEN",
        "--token-env",
        help="Environment variable holding the bearer token clients must send (orchestrators read "
        "GRPO_ENV_TOKEN); required unless --host is a loopback address.",
    ),
    verbose: bool = typer.Option(False, "--verbose", help="Show tracebacks for errors."),
) -> None:
    """Load an environment exactly like the orchestrator does in-process and serve it over HTTP (JSON).

    Point an orchestrator at it with env: [{id: ENV_ID, address: "HOST:PORT"}] in orch.yaml.
    """

    def body() -> int:
        from grpo.config.orchestrator import EnvConfig
        from grpo.envs.loading import load_environment
        from grpo.envs.server import build_app

        token = check_bind(host, token_env)
        environment = load_environment(EnvConfig(id=env_id, args=parse_args_json(args)))
        app = build_app(
            environment,
            env_id,
            max_sessions,
            token=token,
            max_body_bytes=int(max_body_mb * 1024 * 1024),
            max_sessions_per_client=max_sessions_per_client,
            max_example_bytes=int(max_example_kb * 1024),
        )
        try:
            sock = socket.create_server((host, port))
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port") from exc
        return _serve(app, sock, env_id)

    guard("grpo-env", verbose, body)


def _serve(app: Any, sock: Any, env_id: str) -> int:
    import uvicorn

    from grpo.utils.logging import get_logger

    bound_host, bound_port = sock.getsockname()[:2]
    get_logger("envs").info("serving env %s on %s:%d", env_id, bound_host, bound_port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    # uvicorn stops gracefully on SIGINT/SIGTERM (in-flight requests finish), then re-raises the
    # signal to the handler it found installed. Shutdown is done by then: exit 0 like grpo-infer.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    with sock:
        server.run(sockets=[sock])
    return 0


def main() -> None:
    run_app(app, "grpo-env")


if __name__ == "__main__":
    main()
