"""math: procedurally generated arithmetic and linear-equation problems, verified with math-verify.

Offline: problems come from a seeded generator, answers are exact integers or fractions.
"""

from __future__ import annotations

import random
from fractions import Fraction

from grpo.envs.base import check_num_examples
from grpo.envs.single_turn import SingleTurnEnv

SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."


def _arithmetic(rng: random.Random) -> tuple[str, Fraction]:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    op = rng.choice(["+", "-", "*"])
    inner = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"Compute ({a} {op} {b}) * {c}.", Fraction(inner * c)


def _linear(rng: random.Random) -> tuple[str, Fraction]:
    a = rng.choice([n for n in range(-9, 10) if n not in (0,)])
    x = Fraction(rng.randint(-20, 20), rng.choice([1, 1, 2, 3]))
    b = rng.randint(-30, 30)
    rhs = a * x + b
    return f"Solve for x: {a}x + {b} = {rhs}.", x


def _latex(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def make_problems(num_examples: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    makers = [_arithmetic, _linear]
    problems = []
    for _ in range(num_examples):
        question, value = rng.choice(makers)(rng)
        problems.append((question, _latex(value)))
    return problems


def math_verify_reward(completion: str, answer: str) -> float:
    """1.0 when the reply's final answer equals the gold answer mathematically."""
    from math_verify import parse, verify

    # signal-based timeouts only work in the main thread; the reward runner applies its own timeout
    gold = parse(f"${answer}$", parsing_timeout=None)
    pred = parse(completion, parsing_timeout=None)
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


def load_environment(num_examples: int = 1000, seed: int = 0) -> SingleTurnEnv:
    check_num_examples("math", num_examples)
    examples = [{"prompt": q, "answer": a, "task": "math"} for q, a in make_problems(num_examples, seed)]
    return SingleTurnEnv(
        examples=examples, rewards=[math_verify_reward], system_prompt=SYSTEM_PROMPT, name="math"
    )
