"""MkDocs hook (mkdocs.yml `hooks:`): links from docs/ to files elsewhere in the repository.

A page may link to `../examples/gsm8k/` or `../benchmarks/README.md`: the link works where the
Markdown is read in the repository, but the site holds only docs/, so MkDocs would report the target
as missing. This hook checks that each such target exists in the repository (a missing one is a
warning, which `mkdocs build --strict` turns into a failure, as it does for a broken link between
pages) and rewrites the link to the file in the repository's web view when mkdocs.yml sets
`repo_url`, else to its text (a path as code).
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.plugins.grpo_repo_links")

LINK = re.compile(r"(?<!!)\[(?P<text>[^\]\n]+)\]\((?P<target>\.\./[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")
"""An inline Markdown link whose target leaves the page's folder (`../...`); images are left alone."""
FENCE = re.compile(r"^(```|~~~)")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs_dir = Path(config["docs_dir"]).resolve()
    repo_root = docs_dir.parent
    page_dir = posixpath.dirname(page.file.src_uri)
    repo_url = (config.get("repo_url") or "").rstrip("/")

    def rewrite(match: re.Match[str]) -> str:
        target = match["target"]
        in_docs = posixpath.normpath(posixpath.join("docs", page_dir, target))
        if in_docs.startswith("docs/") or in_docs.startswith("../"):
            return match[0]  # a page of the site (MkDocs checks it) or outside the repository
        path = repo_root / in_docs
        if not path.exists():
            log.warning(
                "Doc file '%s' links to '%s', which is not in the repository", page.file.src_uri, target
            )
            return match[0]
        if repo_url:
            kind = "tree" if path.is_dir() else "blob"
            return f"[{match['text']}]({repo_url}/{kind}/main/{in_docs}{match['anchor'] or ''})"
        text = match["text"]
        return text if " " in text or text.startswith("`") else f"`{text}`"

    out: list[str] = []
    in_fence = False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
        out.append(line if in_fence else LINK.sub(rewrite, line))
    return "".join(out)
