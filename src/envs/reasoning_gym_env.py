"""reasoning-gym:<dataset>: procedural tasks of the reasoning_gym package, scored by its own verifier.

`env: [{id: "reasoning-gym:chain_sum", args: {num_examples: 500, seed: 0, min_terms: 2}}]`: besides
num_examples and seed, every arg goes to the dataset's config (reasoning_gym's `<Name>Config`
dataclass; misspelt or mistyped fields are refused before the run starts). The score is the
dataset's `score_answer`, which gives partial credit for some answers that contain the right one;
it is clipped to [0, 1]. The examples are generated when the environment loads: a few datasets
(sudoku, ...) take ~0.1 s per example on a CPU, so keep num_examples small for those.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
import typing
from typing import Any

from grpo.envs.base import check_num_examples
from grpo.envs.single_turn import SingleTurnEnv
from grpo.utils.errors import UserError

SYSTEM_PROMPT = "Think briefly, then give the final answer inside <answer></answer> tags."

_BOXED = re.compile(r"\\boxed\s*\{")


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (braces balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def extract_answer(completion: str) -> str:
    """Text inside the last <answer>...</answer>; else inside the last \\boxed{...}; else the whole reply."""
    start = completion.rfind("<answer>")
    if start == -1:
        boxed = _last_boxed(completion)
        return (boxed if boxed is not None else completion).strip()
    end = completion.find("</answer>", start)
    return completion[start + len("<answer>") : end if end != -1 else None].strip()


def _dataset_names() -> list[str]:
    import reasoning_gym.factory

    return sorted(reasoning_gym.factory.DATASETS)


def check_task_args(task: str, task_args: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Check that `task` is a reasoning-gym dataset and `task_args` fit its config; returns the args
    converted to the config's field types. Raises UserError naming the key and the fix."""
    import reasoning_gym.factory

    from grpo.envs.args import check_args

    where = f"reasoning-gym:{task}"
    names = _dataset_names()
    if not task:
        raise UserError(
            "env id 'reasoning-gym:' needs a dataset name: id: reasoning-gym:<dataset>, e.g. "
            f"reasoning-gym:chain_sum ({len(names)} datasets: {', '.join(names[:8])}, ...)"
        )
    if task not in reasoning_gym.factory.DATASETS:
        close = difflib.get_close_matches(task, names, n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        raise UserError(
            f"env id {where!r}: reasoning-gym has no dataset {task!r}; {hint}list them with: "
            "python -c 'import reasoning_gym; print(sorted(reasoning_gym.factory.DATASETS))'"
        )
    if "size" in task_args:
        raise UserError(
            f"env {where}: use env[].args.num_examples instead of 'size' (the number of examples)"
        )
    _, config_cls = reasoning_gym.factory.DATASETS[task]
    fields = {f.name: f for f in dataclasses.fields(config_cls) if f.name not in ("size", "seed")}
    params = {name: _default(f) for name, f in fields.items()}
    try:
        hints = typing.get_type_hints(config_cls)
    except Exception:  # unresolvable annotations: check names only
        hints = {}
    converted = check_args(where, {"num_examples": 1000, "seed": 0, **params}, hints, task_args)
    try:
        config = config_cls(**converted, size=1, seed=seed)
        if hasattr(config, "validate"):
            config.validate()
    except (AssertionError, ValueError, TypeError) as exc:
        raise UserError(
            f"env {where}: reasoning-gym refused env[].args {task_args}: {exc or type(exc).__name__}; "
            f"see the fields of {config_cls.__name__}"
        ) from None
    return converted


def _default(f: dataclasses.Field[Any]) -> Any:
    """A dataclass field's default, or inspect.Parameter.empty when it has none."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return inspect.Parameter.empty


def load_environment(task: str, num_examples: int = 1000, seed: int = 0, **task_args: Any) -> SingleTurnEnv:
    import reasoning_gym

    where = f"reasoning-gym:{task}"
    check_num_examples(where, num_examples)
    task_args = check_task_args(task, task_args, seed)
    dataset = reasoning_gym.create_dataset(task, size=num_examples, seed=seed, **task_args)
    entries = [dataset[i] for i in range(num_examples)]
    examples = [
        {"prompt": entry["question"], "answer": str(entry["answer"]), "task": task, "info": {"index": i}}
        for i, entry in enumerate(entries)
    ]

    def reasoning_gym_score(completion: str, example: dict[str, Any]) -> float:
        score = dataset.score_answer(extract_answer(completion), entries[example["info"]["index"]])
        # some datasets' partial credit overshoots (spell_backward: 1.0000000000000002 for a wrong answer)
        return min(1.0, max(0.0, float(score)))

    return SingleTurnEnv(
        examples=examples,
        rewards=[reasoning_gym_score],
        system_prompt=SYSTEM_PROMPT,
        name=where,
    )
