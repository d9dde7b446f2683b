"""User documentation describes the project as it is: no development history in it.

README.md, benchmarks/README.md, docs/, examples/ and configs/ are read by users; commit hashes,
issue numbers, the dates of runs, which working session or lent machine measured something, and a
"reference spec" the reader never sees belong in git history, not there. Result files under
benchmarks/results/ record their run's commit and time on purpose and are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Model shapes copied from published config.json files: their content is not ours to word.
EXCLUDED_DIRS = (REPO / "configs/gpu/shapes",)


def _user_docs() -> list[Path]:
    files = [REPO / "README.md", REPO / "benchmarks/README.md"]
    files += sorted((REPO / "docs").rglob("*.md"))
    for folder in ("examples", "configs"):
        for suffix in ("*.md", "*.yaml", "*.yml", "*.py"):
            files += sorted((REPO / folder).rglob(suffix))
    return [
        path
        for path in files
        if path.is_file() and not any(path.is_relative_to(excluded) for excluded in EXCLUDED_DIRS)
    ]


MARKERS: dict[str, re.Pattern[str]] = {
    # 7-40 lower-case hex characters with at least one digit and one letter: a git commit id.
    "commit hash": re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
    "issue or pull-request number": re.compile(r"\b(issue|pr|pull request)s?\s+#?\d+\b|\(#\d+\)", re.I),
    "working session": re.compile(
        r"\b(this|that|same|next|previous|earlier|later|another|last|first|second|third|fourth|fifth|sixth)"
        r"\s+sessions?\b|\bsessions?\s+(so far|later|before|ago)\b|\bsession that (wrote|ran|built)\b",
        re.I,
    ),
    "lent machine": re.compile(
        r"\blent\b|\b(first|second|third|fourth|fifth|sixth|later|next) (H100|H200|GPU) call\b", re.I
    ),
    "undefined reference spec": re.compile(
        r"\breference[- ](spec|quick-?start)|\bthe spec\b|\bspec's\b", re.I
    ),
    "date of a run": re.compile(r"\b20\d\d-(0[1-9]|1[0-2])\b"),
}


def _hits(pattern: re.Pattern[str]) -> list[str]:
    hits = []
    for path in _user_docs():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:160]}")
    return hits


def test_user_documentation_files_are_found() -> None:
    names = {path.relative_to(REPO).as_posix() for path in _user_docs()}
    assert {"README.md", "benchmarks/README.md", "docs/loss.md"} <= names
    assert any(name.startswith("examples/") and name.endswith(".yaml") for name in names)
    assert any(name.startswith("configs/") and name.endswith(".yaml") for name in names)


@pytest.mark.parametrize("kind", sorted(MARKERS))
def test_user_documentation_has_no_history_marker(kind: str) -> None:
    hits = _hits(MARKERS[kind])
    assert not hits, f"{kind} in user documentation (describe what is, not when or by whom):\n" + "\n".join(
        hits
    )


@pytest.mark.parametrize(
    ("kind", "text"),
    [
        ("commit hash", "measured at 657062c on the bf16 machine"),
        ("issue or pull-request number", "no Qwen-VL run yet (issue 32)"),
        ("issue or pull-request number", "fixed in (#56)"),
        ("working session", "Two runs a session later gave 26.0k"),
        ("working session", "not run in this session"),
        ("lent machine", "On a lent H200 the script passed"),
        ("lent machine", "On a fifth H100 call the script found"),
        ("undefined reference spec", "names as in the reference spec"),
        ("undefined reference spec", "# The reference quick-start, with two changes"),
        ("date of a run", "make bench on 2026-12-02"),
    ],
)
def test_each_history_marker_is_caught(kind: str, text: str) -> None:
    assert MARKERS[kind].search(text)


@pytest.mark.parametrize(
    "text",
    [
        "one WebSocket session each",
        "close the session",
        "SHA-256 of the file: deadbeef",
        "decay 1e-5 at step 100",
        "Megatron's local layer spec",
        "the trainer borrows the weights vLLM lends",
    ],
)
def test_technical_wording_is_not_taken_for_history(text: str) -> None:
    assert not any(pattern.search(text) for pattern in MARKERS.values())
