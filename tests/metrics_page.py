"""The metric names docs/metrics.md lists, as patterns a logged name is checked against.

The page's tables whose first column is `name` list them in backticks; `/std` after
`reward/<env>/mean` stands for `reward/<env>/std` (the last part replaced), and a `<...>` part (an
environment's label, a function's name, a turn) matches any one part of a name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

METRICS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def documented_names(page: str) -> list[str]:
    """Every name in the first column of the page's `| name | ...` tables, shorthand expanded."""
    names: list[str] = []
    in_names_table = False
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if not cells:
            in_names_table = False
            continue
        if cells[0] == "name":
            in_names_table = True
            continue
        if not in_names_table or set(cells[0]) <= {"-", ":"}:
            continue
        previous = ""
        for token in re.findall(r"`([^`]+)`", cells[0]):
            name = previous.rsplit("/", 1)[0] + token if token.startswith("/") else token
            names.append(name)
            previous = name
    return names


def name_patterns(names: Iterable[str]) -> list[re.Pattern[str]]:
    return [
        re.compile(
            "".join(
                "[^/]+" if re.fullmatch(r"<[^>]+>", part) else re.escape(part)
                for part in re.split(r"(<[^>]+>)", name)
            )
        )
        for name in names
    ]


def undocumented(logged: Iterable[str], page: str | None = None) -> list[str]:
    """The names in `logged` that no entry of the page (docs/metrics.md unless given) matches."""
    patterns = name_patterns(documented_names(page if page is not None else METRICS_PAGE.read_text()))
    return sorted({name for name in logged if not any(p.fullmatch(name) for p in patterns)})
