"""The import rules of docs/design.md ("Import rules"), checked on every `grpo.*` import under src/.

Every import statement counts wherever it is: module level, inside a function (the lazy imports that
keep `--help` fast), and under `if TYPE_CHECKING:`. A type named in a signature couples two packages as
much as a call does, and such an import turns into a runtime one the day it leaves the block, so an
exemption would only hide the cycle until then. Names looked up from strings at run time (vLLM's
`worker_extension_cls`, user environments) are not imports and are not checked.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "grpo"
"""The package `src/` is imported as; `src/__init__.py` itself counts as package 'grpo'."""

LOWER = ("utils", "models", "config")
ALLOWED: dict[str, frozenset[str]] = {
    ROOT: frozenset({"python_api"}),
    "utils": frozenset(),
    "models": frozenset({"utils"}),
    "config": frozenset({"utils"}),
    "transport": frozenset({"config", "utils"}),
    "envs": frozenset({"config", "utils"}),
    "inference": frozenset({"transport", *LOWER}),
    "trainer": frozenset({"transport", *LOWER}),
    "orchestrator": frozenset({"inference", "envs", "transport", *LOWER}),
    "colocate": frozenset({"orchestrator", "trainer", "inference", "envs", "transport", *LOWER}),
    "doctor": frozenset(LOWER),
    "cli": frozenset(
        {"doctor", "colocate", "orchestrator", "trainer", "inference", "envs", "transport", *LOWER}
    ),
    "python_api": frozenset({"colocate", *LOWER}),
}
"""Top-level package -> the packages it may import (docs/design.md, "Import rules")."""

WHY: dict[tuple[str, str], str] = {
    ("orchestrator", "trainer"): "the orchestrator and the trainer meet only through grpo.transport",
    ("trainer", "orchestrator"): "the orchestrator and the trainer meet only through grpo.transport",
    (
        "trainer",
        "inference",
    ): "the trainer publishes weights through grpo.transport, it never calls inference",
    ("inference", "trainer"): "inference receives weights through grpo.transport, it never calls the trainer",
}
"""The reason to print for a forbidden edge, where a more precise one than the table's exists."""


PEERS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "trainer": (frozenset({"hf", "megatron"}), frozenset({"entry"})),
    "transport": (frozenset({"batches", "weights"}), frozenset()),
}
"""Package -> (its peer sub-packages, its shared modules that may import them). Peers never import each
other, and the shared modules beside them import none of them, except the listed ones (trainer/entry.py
picks the backend): a change inside one peer then touches only it and what is shared
(docs/design.md, "Import rules")."""

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def reason(source: str, target: str) -> str:
    if (source, target) in WHY:
        return WHY[source, target]
    if target == "cli":
        return "nothing imports the CLI"
    if target == "colocate":
        return "only the CLI and grpo.train import colocate (it wires trainer, inference and orchestrator)"
    allowed = ", ".join(f"grpo.{p}" for p in sorted(ALLOWED[source])) or "no other grpo package"
    return f"grpo.{source} may import only {allowed}"


@dataclass(frozen=True)
class Import:
    file: Path
    line: int
    source: str
    """Top-level package of the importing file."""
    target: str
    """Top-level package imported."""
    module: str
    """The dotted name as imported (relative imports resolved)."""

    def where(self) -> str:
        return f"src/{self.file.relative_to(SRC)}:{self.line} imports {self.module}"


def module_parts(file: Path) -> list[str]:
    """`src/a/b.py` -> ['grpo', 'a', 'b']; `src/a/__init__.py` -> ['grpo', 'a']."""
    parts = [ROOT, *file.relative_to(SRC).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def import_statements(tree: ast.AST, package: list[str]) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module, names) for every import at any depth of `tree`: `import a.b` gives ('a.b', []),
    `from a import x, y` gives ('a', ['x', 'y']); relative imports are resolved against `package`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            yield node.lineno, base, [alias.name for alias in node.names]


def grpo_imports(file: Path, text: str | None = None) -> list[Import]:
    """Every `grpo.*` import in `file`, at any depth of the syntax tree."""
    tree = ast.parse(file.read_text() if text is None else text, filename=str(file))
    here = module_parts(file)
    package = here if file.name == "__init__.py" else here[:-1]
    source = here[1] if len(here) > 1 else ROOT
    found = []
    for line, base, names in import_statements(tree, package):
        # `from grpo import cli` imports package cli; `from grpo.cli import x` imports from cli.
        modules = [f"{base}.{n}" for n in names] if base == ROOT else [base]
        for module in modules:
            parts = module.split(".")
            if parts[0] == ROOT and len(parts) > 1 and parts[1] != source:
                found.append(Import(file, line, source, parts[1], module))
    return sorted(found, key=lambda i: i.line)


def all_imports() -> list[Import]:
    return [imp for file in sorted(SRC.rglob("*.py")) for imp in grpo_imports(file)]


def top_level_packages() -> set[str]:
    # A folder of modules is a package with or without __init__.py (config/ has none).
    names = {p.name for p in SRC.iterdir() if p.is_dir() and any(p.rglob("*.py"))}
    return names | {p.stem for p in SRC.glob("*.py") if p.name != "__init__.py"} | {ROOT}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle [a, b, ..., a] of the directed graph, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_every_package_has_a_rule_and_the_rules_form_no_cycle() -> None:
    missing = sorted(top_level_packages() - set(ALLOWED))
    assert not missing, (
        f"src/ has packages with no import rule: {missing}; add them to ALLOWED here and to "
        "docs/design.md (Import rules)"
    )
    cycle = find_cycle({p: set(targets) for p, targets in ALLOWED.items()})
    assert cycle is None, f"the import rules themselves allow a cycle: {' -> '.join(cycle or [])}"


def test_every_grpo_import_keeps_the_rules() -> None:
    broken = [
        f"{imp.where()}: {reason(imp.source, imp.target)}"
        for imp in all_imports()
        if imp.target not in ALLOWED[imp.source]
    ]
    assert not broken, "imports that break docs/design.md (Import rules):\n" + "\n".join(broken)


def test_no_cycle_between_top_level_packages() -> None:
    imports = all_imports()
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.source, set()).add(imp.target)
    cycle = find_cycle(graph)
    if cycle is not None:
        edges = itertools.pairwise(cycle)
        examples = [next(i.where() for i in imports if (i.source, i.target) == edge) for edge in edges]
        pytest.fail(f"package cycle {' -> '.join(cycle)}:\n" + "\n".join(examples))


def test_the_scan_sees_function_local_type_checking_and_relative_imports() -> None:
    # The checks above are only as good as this scan: a missed form of import passes silently.
    text = (
        "from typing import TYPE_CHECKING\n"
        "import grpo.utils.atomic\n"
        "if TYPE_CHECKING:\n"
        "    from grpo.config.trainer import TrainerConfig\n"
        "def f():\n"
        "    from grpo.cli.common import fail\n"
        "    class C:\n"
        "        def g(self):\n"
        "            import grpo.orchestrator.orchestrator as loop\n"
        "from ..transport import batch\n"
        "from grpo import colocate\n"
        "from . import publish\n"
    )
    found = grpo_imports(SRC / "trainer" / "example.py", text)
    assert [(i.line, i.target, i.module) for i in found] == [
        (2, "utils", "grpo.utils.atomic"),
        (4, "config", "grpo.config.trainer"),
        (6, "cli", "grpo.cli.common"),
        (9, "orchestrator", "grpo.orchestrator.orchestrator"),
        (10, "transport", "grpo.transport"),
        (11, "colocate", "grpo.colocate"),
    ]


def peer_breaks() -> list[str]:
    """Imports between peer sub-packages, or from a shared module into a peer, of PEERS' packages."""
    broken = []
    for file in sorted(SRC.rglob("*.py")):
        here = module_parts(file)
        for imp in grpo_imports_within(file):
            package = here[1]
            peers, choosers = PEERS[package]
            target = imp.module.split(".")
            if len(target) < 3 or target[2] not in peers:
                continue
            own = here[2] if len(here) > 2 and (here[2] in peers) else None
            if own == target[2]:
                continue
            if own is None and len(here) > 2 and here[2] in choosers:
                continue
            where = f"src/{file.relative_to(SRC)}:{imp.line} imports {imp.module}"
            if own is None:
                broken.append(
                    f"{where}: shared grpo.{package} modules import no {'/'.join(sorted(peers))} module"
                )
            else:
                broken.append(
                    f"{where}: grpo.{package}.{own} never imports its peer grpo.{package}.{target[2]}"
                )
    return broken


def grpo_imports_within(file: Path, text: str | None = None) -> list[Import]:
    """The `grpo.*` imports of `file` that stay inside its own PEERS package (skipped otherwise)."""
    here = module_parts(file)
    if len(here) < 2 or here[1] not in PEERS:
        return []
    tree = ast.parse(file.read_text() if text is None else text, filename=str(file))
    package = here if file.name == "__init__.py" else here[:-1]
    found = []
    for line, base, names in import_statements(tree, package):
        # `from grpo.trainer import hf` imports peer hf; `from grpo.trainer.hf.model import x`, module hf.model.
        modules = [f"{base}.{n}" for n in names] if names and base.count(".") < 2 else [base]
        found += [Import(file, line, here[1], here[1], m) for m in modules if m.split(".")[:2] == here[:2]]
    return found


def test_peer_sub_packages_never_import_each_other() -> None:
    broken = peer_breaks()
    assert not broken, "imports that break docs/design.md (Import rules, peers):\n" + "\n".join(broken)


def test_the_peer_rule_sees_a_backend_importing_the_other() -> None:
    # The rule above is only as good as this scan: it must see an hf module reaching into megatron.
    here = SRC / "trainer" / "hf" / "example.py"
    text = "def f():\n    from grpo.trainer.megatron.model import build_model\n"
    imports = [i.module for i in grpo_imports_within(here, text)]
    assert "grpo.trainer.megatron.model" in imports


def module_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports, at any depth of its syntax tree. An import of a
    module's own ancestor package is left out: Python runs a package's __init__ before any of its
    modules, so that edge is never a circle anyone wrote."""

    def name_of(file: Path) -> str:
        parts = [*([package] if package else []), *file.relative_to(root).with_suffix("").parts]
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    files = {name_of(f): f for f in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, file in files.items():
        tree = ast.parse(file.read_text(), filename=str(file))
        here = name.split(".") if file.name == "__init__.py" else name.split(".")[:-1]
        for _line, base, names in import_statements(tree, here):
            # `from pkg import mod` imports module pkg.mod where one exists, else names of pkg.
            modules = [f"{base}.{n}" if f"{base}.{n}" in files else base for n in names] or [base]
            for module in modules:
                while module and module not in files:
                    module = module.rpartition(".")[0]
                if module and module != name and not name.startswith(module + "."):
                    graph.setdefault(name, set()).add(module)
    return graph


@pytest.mark.parametrize("tree", ["src", "benchmarks"])
def test_no_module_imports_itself_through_a_circle(tree: str) -> None:
    graph = module_graph(SRC, ROOT) if tree == "src" else module_graph(BENCHMARKS, "")
    cycle = find_cycle(graph)
    assert cycle is None, (
        f"import circle in {tree}/: {' -> '.join(cycle or [])}; move what both need to a module both import"
    )


def test_the_circle_scan_sees_a_circle_through_a_function_local_import(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import g\n")
    assert find_cycle(module_graph(tmp_path, "")) in (["a", "b", "a"], ["b", "a", "b"])
