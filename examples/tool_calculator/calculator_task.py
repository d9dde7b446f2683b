"""A calculator tool and the reward functions of the tool-calling example (rl.yaml here).

`calculate` is a plain typed function: its annotations and docstring become the JSON schema the chat
template shows the model (transformers' get_json_schema). It evaluates + - * / and parentheses over
numbers with Python's ast, never eval, so whatever the model writes runs no code.
"""

from __future__ import annotations

import ast
import operator
import re

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers with + - * / and parentheses, e.g. "(12 + 30) * 3".
    """

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"only numbers and + - * / ( ) are allowed, not {ast.dump(node)[:40]}")

    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def correct(prompts, completions, answer, **kwargs):
    """1.0 when the last number of the model's final words is the answer."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        numbers = re.findall(r"-?\d+(?:\.\d+)?", text.split("</tool_call>")[-1])
        rewards.append(float(bool(numbers) and float(numbers[-1]) == float(expected)))
    return rewards


def used_the_tool(prompts, completions, **kwargs):
    """0.2 for a reply that called a tool (in hermes format) at least once."""
    return [0.2 if "<tool_call>" in (c if isinstance(c, str) else c[-1]["content"]) else 0.0 for c in completions]
