"""reasoning-gym:<task>: procedural tasks of the reasoning_gym package, scored by its own verifier."""

from __future__ import annotations

from typing import Any

from grpo.envs.single_turn import SingleTurnEnv

SYSTEM_PROMPT = "Think briefly, then give the final answer inside <answer></answer> tags."


def extract_answer(completion: str) -> str:
    """Text inside the last <answer>...</answer>, or the whole reply when there is none."""
    start = completion.rfind("<answer>")
    if start == -1:
        return completion.strip()
    end = completion.find("</answer>", start)
    return completion[start + len("<answer>") : end if end != -1 else None].strip()


def load_environment(task: str, num_examples: int = 1000, seed: int = 0, **task_args: Any) -> SingleTurnEnv:
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(task, size=num_examples, seed=seed, **task_args)
    except KeyError as exc:
        raise ValueError(f"unknown reasoning-gym task {task!r}; see reasoning_gym.factory.DATASETS") from exc

    examples = []
    for i in range(num_examples):
        entry = dataset[i]
        examples.append(
            {"prompt": entry["question"], "answer": str(entry["answer"]), "task": task, "info": {"index": i}}
        )

    def reasoning_gym_score(completion: str, example: dict[str, Any]) -> float:
        return float(dataset.score_answer(extract_answer(completion), dataset[example["info"]["index"]]))

    return SingleTurnEnv(
        examples=examples,
        rewards=[reasoning_gym_score],
        system_prompt=SYSTEM_PROMPT,
        name=f"reasoning-gym:{task}",
    )
