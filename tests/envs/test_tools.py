"""Tool calling: schemas from typed functions, the chat template's `tools=`, parsed calls really run,
their results as `tool` messages that never train, errors as text, the turn budget."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from grpo.envs import SingleTurnEnv
from grpo.envs.base import Message
from grpo.envs.tool_env import ToolEnv, with_tools
from grpo.envs.tools import ToolCall, ToolSet
from grpo.inference.types import Completion, GenerateRequest, SamplingParams
from grpo.orchestrator.rollouts.rollout import GroupRequest, RolloutRunner
from grpo.orchestrator.rollouts.tokenizer import ChatTokenizer
from grpo.orchestrator.rollouts.tool_calls import ToolCallParser
from grpo.orchestrator.scheduler import PolicyTracker
from grpo.utils.errors import UserError

CALLS: list[tuple[int, int]] = []


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    CALLS.append((a, b))
    return a + b


def broken(x: str) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("disk on fire")


async def slow(x: str) -> str:
    """Never answers in time.

    Args:
        x: Anything.
    """
    await asyncio.sleep(10)
    return x


def sleepy(x: str) -> str:
    """Blocks its thread past the timeout.

    Args:
        x: Anything.
    """
    time.sleep(1.0)
    return x


def undocumented(a: int) -> int:
    return a


# A template that shows the tools and a template kwarg, so the test can see they reached it.
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% if flavour is defined %}FLAVOUR:{{ flavour }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def test_a_typed_function_with_a_docstring_becomes_a_json_schema() -> None:
    (schema,) = ToolSet("env t", [add]).schemas
    assert schema["type"] == "function"
    assert schema["function"]["name"] == "add"
    assert schema["function"]["description"] == "Add two whole numbers."
    assert schema["function"]["parameters"] == {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "The first number."},
            "b": {"type": "integer", "description": "The second number."},
        },
        "required": ["a", "b"],
    }


def test_a_tool_without_a_docstring_is_refused_with_the_fix() -> None:
    with pytest.raises(UserError, match="docstring"):
        ToolSet("env t", [undocumented])


def test_the_chat_template_gets_the_tools_and_the_template_kwargs(embedded_model_path: Path) -> None:
    tokenizer = ChatTokenizer.from_path(str(embedded_model_path), {"flavour": "plain"})
    tokenizer.hf.chat_template = TOOLS_TEMPLATE
    tools = ToolSet("env t", [add, broken]).schemas
    text = tokenizer.render([{"role": "user", "content": "hi"}], add_generation_prompt=True, tools=tools)
    assert text.startswith("TOOLS:add;broken;FLAVOUR:plain\n")
    assert "TOOLS" not in tokenizer.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert tokenizer.shows_tools(tools)
    assert not ChatTokenizer.from_path(str(embedded_model_path)).shows_tools(tools)  # SmolLM2's template


def test_a_hermes_reply_parses_into_calls(embedded_model_path: Path) -> None:
    tokenizer = ChatTokenizer.from_path(str(embedded_model_path))
    parser = ToolCallParser(tokenizer, None)
    assert parser.name == "hermes"  # SmolLM2's tokenizer has no response_template
    tools = ToolSet("env t", [add]).schemas
    reply = "Let me add.\n" + hermes("add", '{"a": 2, "b": 40}') + hermes("add", '{"a": 1, "b": 1}')
    ids = tokenizer.encode(reply) + tokenizer.encode(tokenizer.eos_token)
    calls = parser.parse(ids, [], tools)
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 2, "b": 40}), ("add", {"a": 1, "b": 1})]
    assert parser.parse(tokenizer.encode("The answer is 42."), [], tools) == []
    # malformed JSON: no call, the turn is a plain reply
    assert (
        parser.parse(
            tokenizer.encode('<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>'), [], tools
        )
        == []
    )
    assert parser.parse(tokenizer.encode(hermes("add", '"2 and 40"')), [], tools) == []


def test_an_unknown_parser_name_fails_at_the_start_with_the_names(embedded_model_path: Path) -> None:
    tokenizer = ChatTokenizer.from_path(str(embedded_model_path))
    with pytest.raises(UserError, match="hermes"):
        ToolCallParser(tokenizer, "no-such-parser")


class FakeTemplateTokenizer:
    """A tokenizer with its own response parsing (transformers' response_template / parse_response)."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf
        self.response_template = {"stand-in": True}
        self.seen: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.hf, name)

    def parse_response(self, text: str, prefix: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
        self.seen.append((text, prefix))
        return {
            "role": "assistant",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
        }


def test_a_tokenizer_with_a_response_template_parses_its_own_calls(embedded_model_path: Path) -> None:
    tokenizer = ChatTokenizer.from_path(str(embedded_model_path))
    tokenizer.hf = FakeTemplateTokenizer(tokenizer.hf)
    parser = ToolCallParser(tokenizer, None)
    assert parser.name == "response_template"
    prefix = tokenizer.encode("<|im_start|>assistant\n")
    (call,) = parser.parse(tokenizer.encode("call add") + tokenizer.encode(tokenizer.eos_token), prefix, [])
    assert (call.name, call.arguments) == ("add", {"a": 1, "b": 2})
    assert tokenizer.hf.seen == [("call add", "<|im_start|>assistant\n")]  # end of turn cut, prefix decoded


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_tool_that_raises_or_times_out_answers_with_an_error_text() -> None:
    tools = ToolSet("env t", [add, broken, slow, sleepy], timeout=0.2)
    ok = run(tools.run(ToolCall("add", {"a": 2, "b": 3}, "call-1")))
    assert not ok.error and ok.message == {
        "role": "tool",
        "name": "add",
        "content": "5",
        "tool_call_id": "call-1",
    }
    raised = run(tools.run(ToolCall("broken", {"x": "y"})))
    assert raised.error and raised.message["content"] == "Error: broken raised RuntimeError: disk on fire"
    for name in ("slow", "sleepy"):
        timed_out = run(tools.run(ToolCall(name, {"x": "y"})))
        assert timed_out.error and timed_out.message["content"] == f"Error: {name} timed out after 0.2s"
    unknown = run(tools.run(ToolCall("multiply", {"a": 1})))
    assert unknown.error and "no tool named 'multiply'" in unknown.message["content"]
    bad_args = run(tools.run(ToolCall("add", {"a": 1, "c": 2})))
    assert bad_args.error and "bad arguments for add" in bad_args.message["content"]


class ScriptedClient:
    """Replies with the next scripted text, tokenised by the real tokenizer, then end-of-turn."""

    def __init__(self, tokenizer: ChatTokenizer, replies: list[str], cut: bool = False) -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.prompts: list[list[int]] = []
        self.cut = cut
        """Every reply stops at max_tokens (no end of turn)."""

    async def generate(self, request: GenerateRequest) -> list[Completion]:
        self.prompts.append(request.prompt_token_ids)
        text = self.replies.pop(0)
        if self.cut:
            ids = self.tokenizer.encode(text)
            return [Completion(ids, [-0.1] * len(ids), text, "length")]
        ids = self.tokenizer.encode(text) + self.tokenizer.encode(self.tokenizer.eos_token)
        return [Completion(ids, [-0.1] * len(ids), text, "stop")]

    def end_session(self, session_id: str) -> None:
        return None


def answer_42(completion: str) -> float:
    return float(completion.strip().endswith("42"))


def play(
    tokenizer: ChatTokenizer, replies: list[str], env: ToolEnv, tmp_path: Path, cut: bool = False
) -> tuple[Any, ScriptedClient, list[Message]]:
    client = ScriptedClient(tokenizer, replies, cut)
    runner = RolloutRunner(
        client,  # type: ignore[arg-type]
        tokenizer,
        PolicyTracker(tmp_path, client, "default", "m"),  # type: ignore[arg-type]
        tool_parser=ToolCallParser(tokenizer, "hermes"),
    )
    seen: list[Message] = []
    inner_score = env.inner.score

    async def score(example: Any, completion: list[Message], state: Any) -> Any:
        seen.extend(completion)
        return await inner_score(example, completion, state)

    env.inner.score = score  # type: ignore[method-assign]
    group = run(runner.run_group(GroupRequest(0, env, 0, env.examples[0], 1, SamplingParams())))
    return group.rollouts[0], client, seen


def calculator_env(max_turns: int, *functions: Any, prompt: Any = "What is 2 + 40?") -> ToolEnv:
    inner = SingleTurnEnv(examples=[{"prompt": prompt}], rewards=[answer_42])
    return with_tools(inner, ToolSet("env calc", list(functions or [add]), timeout=0.5), max_turns)


def test_a_parsed_call_really_runs_and_its_result_is_a_tool_message_that_never_trains(
    embedded_model_path: Path, tmp_path: Path
) -> None:
    tokenizer = ChatTokenizer.from_path(str(embedded_model_path))
    CALLS.clear()
    call = hermes("add", '{"a": 2, "b": 40}')
    rollout, client, completion = play(tokenizer, [call, "It is 42"], calculator_env(4), tmp_path)

    assert CALLS == [(2, 40)]
    assert [m["role"] for m in completion] == ["assistant", "tool", "assistant"]
    assert completion[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 40}}
    assert completion[1]["content"] == "42" and completion[1]["name"] == "add"
    assert (rollout.num_tool_calls, rollout.num_tool_errors, rollout.reward) == (1, 0, 1.0)

    # the second turn's context extends the first exactly: the rollout's ids stay one token sequence
    full = rollout.prompt_ids + rollout.completion_ids
    assert client.prompts[1] == full[: len(client.prompts[1])]
    history = [
        {"role": "user", "content": "What is 2 + 40?"},
        {"role": "assistant", "content": call},
        completion[1],
    ]
    assert client.prompts[1] == tokenizer.encode(tokenizer.render(history, add_generation_prompt=True))
    # only the model's two turns train; the tool message (and the template around it) is masked
    trained = [t for t, m in zip(rollout.completion_ids, rollout.completion_mask, strict=True) if m]
    masked = [t for t, m in zip(rollout.completion_ids, rollout.completion_mask, strict=True) if not m]
    assert tokenizer.hf.decode(trained).replace(tokenizer.eos_token, "") == call + "It is 42"
    assert "42" in tokenizer.hf.decode(masked) and "tool" in tokenizer.hf.decode(masked)
    assert all(
        lp == 0.0 for lp, m in zip(rollout.completion_logprobs, rollout.completion_mask, strict=True) if not m
    )


def test_a_failing_tool_is_an_error_message_not_a_failed_rollout(
    embedded_model_path: Path, tmp_path: Path
) -> None:
    tokenizer = ChatTokenizer.from_path(str(embedded_model_path))
    env = calculator_env(4, add, broken)
    rollout, _, completion = play(tokenizer, [hermes("broken", '{"x": "1"}'), "42"], env, tmp_path)
    assert rollout.failure is None and rollout.reward == 1.0
    assert completion[1] == {
        "role": "tool",
        "name": "broken",
        "content": "Error: broken raised RuntimeError: disk on fire",
        "tool_call_id": completion[0]["tool_calls"][0]["id"],
    }
    assert (rollout.num_tool_calls, rollout.num_tool_errors) == (1, 1)


def test_a_malformed_call_ends_the_tool_loop_like_a_plain_reply(
    embedded_model_path: Path, tmp_path: Path
) -> None:
    tokenizer = ChatTokenizer.from_path(str(embedded_model_path))
    CALLS.clear()
    rollout, client, completion = play(
        tokenizer,
        ['<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>', "unused"],
        calculator_env(4),
        tmp_path,
    )
    assert len(client.prompts) == 1 and CALLS == []
    assert [m["role"] for m in completion] == ["assistant"] and "tool_calls" not in completion[0]
    assert rollout.failure is None and rollout.num_tool_calls == 0


def test_max_turns_bounds_the_model_turns_and_the_last_turns_calls_do_not_run(
    embedded_model_path: Path, tmp_path: Path
) -> None:
    tokenizer = ChatTokenizer.from_path(str(embedded_model_path))
    CALLS.clear()
    call = hermes("add", '{"a": 1, "b": 1}')
    rollout, client, completion = play(tokenizer, [call, call, call, "unused"], calculator_env(2), tmp_path)
    assert len(client.prompts) == 2  # two model turns
    assert CALLS == [(1, 1)]  # the second turn's call is not run: no turn is left to read its result
    assert [m["role"] for m in completion] == ["assistant", "tool", "assistant"]
    assert rollout.num_tool_calls == 1


def test_max_turns_without_tools_and_tools_on_a_remote_env_are_refused() -> None:
    from pydantic import ValidationError

    from grpo.config.orchestrator import EnvConfig
    from grpo.config.sections.dataset_env import DatasetEnvConfig

    with pytest.raises(ValidationError, match="max_turns applies to tool calls"):
        DatasetEnvConfig(dataset="d.jsonl", reward_funcs=["m:f"], max_turns=3)
    with pytest.raises(ValidationError, match="tools run in the orchestrator's process"):
        EnvConfig(id="x", address="127.0.0.1:9000", tools=["m:f"])
    with pytest.raises(ValidationError, match="names no function"):
        EnvConfig(id="reverse-text", tools=["calc.add"])


def test_a_dataset_block_with_tools_loads_as_a_group_scoring_tool_env(
    tmp_path: Path, monkeypatch: Any
) -> None:
    from grpo.config.sections.dataset_env import DatasetEnvConfig
    from grpo.envs.base import GroupScoring
    from grpo.envs.loading import load_environment
    from grpo.envs.tool_env import ToolUse

    (tmp_path / "q.jsonl").write_text('{"prompt": "2 + 40?", "answer": "42"}\n')
    (tmp_path / "calc_task.py").write_text(
        "def add(a: int, b: int) -> int:\n"
        '    """Add.\n\n    Args:\n        a: first\n        b: second\n    """\n'
        "    return a + b\n\n\n"
        "def correct(prompts, completions, answer, **kw):\n"
        "    return [float(a in c) for c, a in zip(completions, answer)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = DatasetEnvConfig(
        dataset=str(tmp_path / "q.jsonl"),
        reward_funcs=["calc_task:correct"],
        tools=["calc_task:add"],
        max_turns=3,
    )
    env = load_environment(cfg)
    assert isinstance(env, ToolUse) and isinstance(env, GroupScoring)
    assert (env.name, env.max_turns, [s["function"]["name"] for s in env.tools.schemas]) == ("q", 3, ["add"])


def test_a_prefilled_call_cut_at_max_tokens_still_runs_and_its_turn_is_closed_by_a_masked_token(
    embedded_model_path: Path, tmp_path: Path
) -> None:
    tokenizer = ChatTokenizer.from_path(str(embedded_model_path))
    CALLS.clear()
    call = hermes("add", '{"a": 2, "b": 40}')
    prompt = [{"role": "user", "content": "What is 2 + 40?"}, {"role": "assistant", "content": call}]
    env = calculator_env(2, prompt=prompt)
    rollout, client, completion = play(tokenizer, [" and then", "so 42"], env, tmp_path, cut=True)

    assert CALLS == [(2, 40)]  # the call came from the prefill, read together with the sampled text
    assert tokenizer.hf.decode(client.prompts[0]).endswith("<|im_start|>assistant\n" + call)  # continued
    assert completion[0]["content"] == call + " and then" and completion[1]["content"] == "42"
    full = rollout.prompt_ids + rollout.completion_ids
    assert client.prompts[1] == full[: len(client.prompts[1])]
    first_turn = len(tokenizer.encode(" and then"))
    assert rollout.completion_mask[:first_turn] == [True] * first_turn
    closing = rollout.completion_ids[first_turn : first_turn + 1]
    assert tokenizer.hf.decode(closing) == tokenizer.end_of_turn_token
    assert rollout.completion_mask[first_turn] is False


def test_a_malformed_call_is_parsed_quietly(
    embedded_model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer = ChatTokenizer.from_path(str(embedded_model_path))
    parser = ToolCallParser(tokenizer, "hermes")
    with caplog.at_level("DEBUG"):
        assert (
            parser.parse(
                tokenizer.encode('<tool_call>{"name": "add", "argu'), [], ToolSet("t", [add]).schemas
            )
            == []
        )
    assert not [r for r in caplog.records if "tool call" in r.getMessage().lower()]
