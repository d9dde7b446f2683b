"""docs/metrics.md lists every metric a run logs.

Two ways in: the names in the source (a run logs only names the code spells), read without running
anything, and the rows a real trainer step writes (tests/orchestrator/test_metrics_documented.py does
the same for an orchestrator run). In the source a metric is either a name with a `/` anywhere under
src/ (`reward/<env>/mean`; an f-string's fields read as `<x>`), or a key of the dicts that the
functions building a step's row fill in (`loss`, `mfu`, ...).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

from metrics_page import METRICS_PAGE, documented_names, undocumented

SRC = Path(__file__).resolve().parents[1] / "src"

NAMESPACED = r"[a-z][a-z0-9_]*(/[a-z0-9_<>]+)+"
FLAT = r"[a-z][a-z0-9_]*"

NOT_METRICS = {
    "application/json": "an HTTP content type",
    "yes/no": "a judge's verdict parser",
    "outputs/doctor": "grpo doctor's default --out folder",
    "tokens/s": "a plot's axis label (grpo-report)",
    "packing/num_tokens": "a sum over a step's parts, turned into packing/efficiency before the row",
    "packing/num_sample_tokens": "likewise, turned into packing/shared_frac",
    "grpo/weights": "the weight collective's store prefix",
    "knock/rank": "a weight collective store key",
    "knock/rank<x>": "a weight collective store key",
    "session/<x>": "a weight collective store key",
    "update/<x>": "a weight collective store key",
    "stream/num_parts": "a streamed batch's metadata",
    "stream/part": "a streamed batch's metadata",
    "stream/step": "a streamed batch's metadata",
    "outputs/run_default": "a default output directory",
    "step": "each row's step, not a metric",
    "num_rollouts_dropped_off_policy": "a checkpointed counter (its metric is off_policy/num_dropped)",
}
"""Names of metric shape in the code that are not metrics, and what each is."""

ROW_BUILDERS = {
    "trainer/loss.py": ["LossSums.metrics"],
    "trainer/step_report.py": ["step_metrics", "peak_memory_metrics", "StepReport.write"],
    "trainer/flops.py": ["flop_rate_metrics"],
    "trainer/hf/trainer.py": ["Trainer.finish_step"],
    "trainer/hf/moe.py": ["*.take_metrics"],
    "trainer/megatron/moe.py": ["*.take_metrics"],
    "trainer/megatron/trainer.py": ["MegatronTrainer.train_step"],
    "orchestrator/batching/step_batch.py": [
        "rollout_metrics",
        "tool_metrics",
        "turn_metrics",
        "pack_metrics",
    ],
    "orchestrator/orchestrator.py": ["Orchestrator._steps"],
    "orchestrator/reporting/report.py": ["Reporter._log_wandb"],
}
"""Module under src/ -> the functions that put a step's metrics in a dict (`Class.method`, `*.method`
for that method of any class, `*` for every function of the module)."""


def _text(node: ast.AST) -> str | None:
    """A string literal, or an f-string with each field read as `<x>`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "<x>" for v in node.values)
    return None


def _strings(tree: ast.AST) -> Iterator[str]:
    """Every string of `tree` (an f-string whole, not its parts)."""
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        text = _text(node)
        if text is not None and id(node) not in parts:
            yield text


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node
            yield "*", node
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield from ((f"{node.name}.{sub.name}", sub), (f"*.{sub.name}", sub), ("*", sub))


def _dict_keys(function: ast.AST) -> Iterator[str]:
    """The keys a function writes into dicts: dict literals and `d[key] = ...`."""
    for node in ast.walk(function):
        keys: list[ast.AST | None] = []
        if isinstance(node, ast.Dict):
            keys = list(node.keys)
        elif isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            keys = [t.slice for t in targets if isinstance(t, ast.Subscript)]
        for key in keys:
            text = _text(key) if key is not None else None
            if text is not None:
                yield text


@functools.cache
def namespaced_names_in_source() -> set[str]:
    import re

    names: set[str] = set()
    for path in SRC.rglob("*.py"):
        names.update(s for s in _strings(ast.parse(path.read_text())) if re.fullmatch(NAMESPACED, s))
    return names


@functools.cache
def row_builder_names() -> set[str]:
    import re

    names: set[str] = set()
    for module, wanted in ROW_BUILDERS.items():
        functions: dict[str, list[ast.AST]] = {}
        for name, node in _functions(ast.parse((SRC / module).read_text())):
            functions.setdefault(name, []).append(node)
        for name in wanted:
            assert name in functions, f"src/{module} has no {name}: update ROW_BUILDERS"
            for function in functions[name]:
                names.update(k for k in _dict_keys(function) if re.fullmatch(f"{FLAT}|{NAMESPACED}", k))
    return names


def test_every_metric_name_in_the_source_is_on_the_metrics_page() -> None:
    names = (namespaced_names_in_source() | row_builder_names()) - set(NOT_METRICS)
    missing = undocumented(names)
    assert not missing, f"add these to docs/metrics.md (or to NOT_METRICS here if not a metric): {missing}"


def test_the_source_scan_finds_the_metrics_of_both_sides() -> None:
    names = namespaced_names_in_source() | row_builder_names()
    expected = {
        "reward/<x>/<x>/mean",
        "tools/<x>/calls_per_rollout",
        "pool/num_recoveries",
        "time/step",
        "loss",
        "mismatch_kl",
        "mfu",
        "routing_mismatch_fraction",
    }
    assert expected <= names


def fixed_reward_metric_names() -> set[str]:
    """The names an environment of src/envs always scores besides its reward (`Score(metrics=...)`
    from a dict literal), each logged as `reward/<env>/<name>/mean` and `/std`."""
    names: set[str] = set()
    for path in (SRC / "envs").rglob("*.py"):
        for _name, function in _functions(ast.parse(path.read_text())):
            calls = [n for n in ast.walk(function) if isinstance(n, ast.Call) and _called(n) == "Score"]
            passed = [k.value for c in calls for k in c.keywords if k.arg == "metrics"]
            variables = {v.id for v in passed if isinstance(v, ast.Name)}
            for node in ast.walk(function):
                if (
                    isinstance(node, ast.Assign)
                    and isinstance(node.value, ast.Dict)
                    and any(isinstance(t, ast.Name) and t.id in variables for t in node.targets)
                ):
                    names.update(_dict_keys(node.value))
            for value in passed:
                if isinstance(value, ast.Dict):
                    names.update(_dict_keys(value))
    return names


def _called(call: ast.Call) -> str | None:
    return call.func.id if isinstance(call.func, ast.Name) else None


def test_the_fixed_reward_metrics_of_built_in_environments_are_each_on_the_metrics_page() -> None:
    names = fixed_reward_metric_names()
    assert {"num_steps", "episode_done"} <= names  # OpenEnv's
    listed = set(documented_names(METRICS_PAGE.read_text()))
    missing = sorted(n for n in names if f"reward/<env>/{n}/mean" not in listed)
    assert not missing, f"list reward/<env>/<name>/mean for each in docs/metrics.md: {missing}"


def test_a_name_the_page_does_not_list_is_reported_and_placeholders_match_one_part() -> None:
    page = (
        "| name | meaning |\n|---|---|\n"
        "| `reward/<env>/mean`, `/std` | x |\n| `loss` | y |\n\n"
        "| file | rows |\n|---|---|\n| `other` | z |\n"
    )
    assert documented_names(page) == ["reward/<env>/mean", "reward/<env>/std", "loss"]
    logged = ["reward/toy#0/std", "loss", "reward/a/b/mean", "other", "loss/extra"]
    assert undocumented(logged, page) == ["loss/extra", "other", "reward/a/b/mean"]


def test_a_trained_step_logs_only_names_the_metrics_page_lists(tmp_path: Path, tiny_model_path: Path) -> None:
    from trained_runs import train_and_publish

    from grpo.utils.jsonl import read_jsonl

    train_and_publish(tmp_path, tiny_model_path, lora=True)
    rows = read_jsonl(tmp_path / "trainer_metrics.jsonl")
    logged = {key for row in rows for key in row} - {"step"}
    assert {"loss", "mismatch_kl", "grad_norm"} <= logged
    assert not undocumented(logged), undocumented(logged)
