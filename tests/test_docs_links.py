"""scripts/mkdocs_repo_links.py, the docs site's hook for links from docs/ to the rest of the
repository: a target that exists becomes its path (or its page under repo_url), a missing one is a
warning (which `mkdocs build --strict`, run by `make docs`, turns into a failure)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mkdocs_repo_links", REPO / "scripts/mkdocs_repo_links.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _render(markdown: str, repo_url: str | None = None, page: str = "own_task.md") -> str:
    config = {"docs_dir": str(REPO / "docs"), "repo_url": repo_url}
    return _hook().on_page_markdown(
        markdown, SimpleNamespace(file=SimpleNamespace(src_uri=page)), config, None
    )


def test_a_link_to_a_repository_folder_becomes_its_path_on_the_site() -> None:
    out = _render("See [examples/gsm8k/](../examples/gsm8k/) and [the results](../benchmarks/README.md).")
    assert out == "See `examples/gsm8k/` and the results."


def test_with_repo_url_a_link_points_at_the_file_in_the_repository() -> None:
    out = _render(
        "[`benchmarks/README.md`](../benchmarks/README.md#results)", repo_url="https://example.org/grpo/"
    )
    assert out == "[`benchmarks/README.md`](https://example.org/grpo/blob/main/benchmarks/README.md#results)"
    out = _render("[x](../examples/gsm8k/)", repo_url="https://example.org/grpo")
    assert out == "[x](https://example.org/grpo/tree/main/examples/gsm8k)"


def test_a_link_to_a_missing_repository_file_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        out = _render("[gone](../examples/no_such_example/)")
    assert out == "[gone](../examples/no_such_example/)"
    assert "links to '../examples/no_such_example/', which is not in the repository" in caplog.text


def test_links_between_pages_and_inside_code_blocks_are_left_to_mkdocs() -> None:
    markdown = "[loss](loss.md#notation)\n```\n[x](../examples/nope/)\n```\n![img](../x.png)\n"
    assert _render(markdown) == markdown
