"""The shell commands user documentation shows: every line of a fenced shell block that runs a `grpo`
command (grpo, grpo-train, grpo-infer, ...), with its `\\` continuations joined, its comment cut and
any leading `VAR=value` assignments split off.

Shell blocks are fences tagged bash, sh, shell or console; an untagged or ```text fence shows output,
a diagram or a synopsis, and is not run. A block whose command cannot run on any machine
the tests run on is marked, on the line right above its fence, with `<!-- no-dry-run: why -->`.
Lines ending in `&` start background processes the block's other commands need (a server).

A page may show the files its commands use instead of pointing at the repository's: a fence whose
first line is a comment naming a relative path that is not in the repository (`# my_task/rl.yaml`)
holds that file's content (the comment line left out). `shown_files` collects them, so that the
commands can run where those files exist beside the repository's own.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHELL_FENCES = {"bash", "sh", "shell", "console"}
EXECUTABLES = {"grpo", "grpo-train", "grpo-infer", "grpo-orch", "grpo-model", "grpo-env", "grpo-report"}
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
NO_DRY_RUN = re.compile(r"<!--\s*no-dry-run:\s*\S.*-->")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
FILE_HEADER = re.compile(r"^\s*(?:#|//)\s*(?P<path>\w[\w.-]*(?:/[\w.-]+)*\.(?:ya?ml|py|jsonl|json|txt))\b")


@dataclass
class Command:
    """One command line as documented."""

    source: str
    """file:line of its first line, relative to the repository root."""
    env: dict[str, str]
    """Its leading VAR=value assignments."""
    argv: list[str]
    background: list[Command] = field(default_factory=list)
    """The `... &` commands of its block, which it needs running."""
    files: dict[str, str] = field(default_factory=dict)
    """The files its page shows whole (shown_files)."""

    @property
    def text(self) -> str:
        assignments = [f"{k}={v}" for k, v in self.env.items()]
        return shlex.join([*assignments, *self.argv])


def documentation_files() -> list[Path]:
    """README.md, docs/**/*.md and examples/*/README.md."""
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    return [*files, *sorted(REPO.glob("examples/*/README.md"))]


def documented_commands(path: Path) -> list[Command]:
    """The grpo commands in `path`'s shell fences, each with its block's background commands."""
    commands: list[Command] = []
    files = shown_files(path)
    for block in _shell_blocks(path):
        lines = [_parse(path, number, text) for number, text in block]
        background = [c for c, bg in lines if c is not None and bg]
        for command, is_background in lines:
            if command is not None and not is_background and command.argv[0] in EXECUTABLES:
                command.background, command.files = background, files
                commands.append(command)
    return commands


def shown_files(path: Path) -> dict[str, str]:
    """The files `path` shows whole (relative path: content) that the repository does not hold."""
    files = {}
    for _, _, _, body in _fences(path):
        header = FILE_HEADER.match(body[0]) if body else None
        if header is not None and not (REPO / header["path"]).exists():
            files[header["path"]] = "".join(f"{line}\n" for line in body[1:])
    return files


def _shell_blocks(path: Path) -> list[list[tuple[int, str]]]:
    """Each runnable shell fence's logical lines (continuations joined) with their first line's number."""
    return [
        _logical_lines(body, first)
        for language, previous, first, body in _fences(path)
        if language in SHELL_FENCES and not NO_DRY_RUN.search(previous)
    ]


def _fences(path: Path) -> list[tuple[str, str, int, list[str]]]:
    """Each fence's language, the last non-blank line above it, its first line's number and its lines."""
    fences = []
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        marker, language = opening.group(1), opening.group(2).lower()
        previous = next((line for line in reversed(lines[:index]) if line.strip()), "")
        body_start = index + 1
        index = body_start
        while index < len(lines) and not lines[index].strip().startswith(marker):
            index += 1
        fences.append((language, previous, body_start + 1, lines[body_start:index]))
        index += 1
    return fences


def _logical_lines(body: list[str], first_number: int) -> list[tuple[int, str]]:
    joined: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for offset, line in enumerate(body):
        text = line.strip().removeprefix("$ ")
        if pending is not None:
            text = f"{pending[1]} {text}"
        number = pending[0] if pending is not None else first_number + offset
        if text.endswith("\\"):
            pending = (number, text[:-1].rstrip())
            continue
        pending = None
        if text:
            joined.append((number, text))
    if pending is not None:
        joined.append(pending)
    return joined


def _parse(path: Path, number: int, text: str) -> tuple[Command | None, bool]:
    """The command on one logical line (None for a comment or a line that is not one) and whether it
    runs in the background."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return None, False
    background = bool(words) and words[-1] == "&"
    if background:
        words = words[:-1]
    env = {}
    while words and ASSIGNMENT.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if not words or any(w in ("|", "&&", ";", "||") for w in words):
        return None, False
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    return Command(f"{shown}:{number}", env, words), background
