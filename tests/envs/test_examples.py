"""The example configs name environments that load, and the user multi-turn example plays by its rules."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from grpo.config.config_set import load_run
from grpo.config.loading import read_yaml
from grpo.config.orchestrator import EnvConfig, OrchestratorConfig
from grpo.envs import load_environment
from grpo.envs.loading import check_environments

REPO = Path(__file__).resolve().parents[2]
MULTI_TURN = REPO / "examples" / "multi_turn"
OPENENV = REPO / "examples" / "openenv"
ORCH_CONFIGS = sorted(REPO.glob("examples/*/orch.yaml")) + sorted(REPO.glob("configs/*/orch.yaml"))
"""Three-file sets' orch.yaml (every example's rl.yaml: tests/config/test_shipped_configs.py)."""


def _orch_of(rl_yaml: Path) -> OrchestratorConfig:
    configs, _ = load_run(None, rl_yaml, {})
    orch = configs["orch"]
    assert isinstance(orch, OrchestratorConfig)
    return orch


@pytest.mark.parametrize("path", ORCH_CONFIGS, ids=[str(p.relative_to(REPO)) for p in ORCH_CONFIGS])
def test_example_orch_configs_name_loadable_environments(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    check_environments(OrchestratorConfig.model_validate(read_yaml(path)))


def test_guess_number_multi_turn_example(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(MULTI_TURN))
    env = load_environment(
        EnvConfig(id="guess_number:load_environment", args={"num_examples": 2, "max_turns": 3})
    )
    assert env.max_turns == 3 and env.name == "guess_number:load_environment"
    example = env.examples[0]
    target = int(example["answer"])

    async def play(*guesses: str) -> float:
        state = await env.reset(example)
        history: list[dict[str, str]] = []
        for guess in guesses:
            history.append({"role": "assistant", "content": guess})
            reply = await env.step(history, state)
            history += reply.messages
            if reply.done:
                break
        score = await env.score(example, history, state)
        assert not score.failed, score.failure
        return score.reward

    wrong = target + 1 if target < 10 else target - 1
    assert asyncio.run(play(str(target))) == 1.0
    assert asyncio.run(play(f"maybe {wrong}", f"then {target}")) == 0.5
    assert asyncio.run(play(str(wrong), str(wrong), str(wrong))) == 0.0
    with pytest.raises(ValueError, match=r"unknown arg 'hgh'.*did you mean 'high'"):
        load_environment(EnvConfig(id="guess_number:load_environment", args={"hgh": 5}))


def test_gsm8k_example_rewards_the_right_boxed_answer() -> None:
    env = load_environment(_orch_of(REPO / "examples/gsm8k/rl.yaml").env[0])
    assert env.name == "gsm8k" and len(env.examples) == 12
    example = env.examples[0]
    assert example["prompt"].startswith("Mia buys") and example["answer"].endswith("#### 29")
    replies = ["36 - 7 = 29, so \\boxed{29}", "The answer is 29.", "\\boxed{30}"]
    scores = asyncio.run(
        env.score_group(example, [[{"role": "assistant", "content": r}] for r in replies], [[1], [2], [3]])  # type: ignore[attr-defined]
    )
    assert [s.reward for s in scores] == [1.2, 1.0, 0.2]


def test_vision_qa_example_puts_each_picture_before_its_question_and_rewards_the_exact_word() -> None:
    env = load_environment(_orch_of(REPO / "examples/vision_qa/rl.yaml").env[0])
    assert env.name == "vision_qa" and len(env.examples) == 24
    example = env.examples[0]
    (user,) = env.prompt_messages(example)
    image, text = user["content"]
    assert image["type"] == "image" and image["image"].size == (64, 64)
    assert image["image"].decode().getpixel((32, 32)) == (220, 30, 30) and example["answer"] == "red"
    assert text == {"type": "text", "text": "What colour is the shape? Answer with one word."}
    replies = ["Red.", "red, I think", "blue"]
    scores = asyncio.run(
        env.score_group(example, [[{"role": "assistant", "content": r}] for r in replies], [[1], [2], [3]])  # type: ignore[attr-defined]
    )
    assert [s.reward for s in scores] == [1.2, 0.0, 0.2]


def test_vision_qa_example_data_is_what_its_script_draws(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util
    import shutil

    folder = REPO / "examples" / "vision_qa"
    shutil.copy(folder / "make_data.py", tmp_path / "make_data.py")
    spec = importlib.util.spec_from_file_location("make_vision_qa", tmp_path / "make_data.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    assert (tmp_path / "vision_qa.jsonl").read_text() == (folder / "vision_qa.jsonl").read_text()
    drawn = sorted(p.name for p in (tmp_path / "images").iterdir())
    assert drawn == sorted(p.name for p in (folder / "images").iterdir()) and len(drawn) == 12
    assert all((tmp_path / "images" / n).read_bytes() == (folder / "images" / n).read_bytes() for n in drawn)


def test_tool_calculator_example_evaluates_arithmetic_only_and_rewards_the_final_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(REPO / "examples" / "tool_calculator"))
    import calculator_task

    assert calculator_task.calculate("(12 + 30) * 3") == "126"
    assert calculator_task.calculate("9876 / 12") == "823"
    with pytest.raises(ValueError, match="only numbers"):
        calculator_task.calculate("__import__('os').getcwd()")
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "17 * 23"}}</tool_call>'
    completions = [call + "\nIt is 391.", "391? No, 390.", call]
    assert calculator_task.correct(None, completions, ["391"] * 3) == [1.0, 0.0, 0.0]
    assert calculator_task.used_the_tool(None, completions) == [0.2, 0.0, 0.2]


def test_verifiers_example_answers_each_guess_until_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "examples" / "verifiers"))
    env = load_environment(EnvConfig(id="vf-guess-number", args={"num_rows": 4, "high": 10}))
    assert env.max_turns == 4  # the Env's player seat says so
    example = env.examples[0]
    target = int(example["info"]["target"])

    async def play(*guesses: str) -> tuple[list[str], float]:
        state = await env.reset(example)
        history = env.prompt_messages(example)
        hints = []
        for guess in guesses:
            history.append({"role": "assistant", "content": guess})
            reply = await env.step(history, state)
            hints += [m["content"] for m in reply.messages]
            history += reply.messages
            if reply.done:
                break
        score = await env.score(example, history[2:], state)
        assert not score.failed, score.failure
        return hints, score.reward

    low, high = (target - 1, target + 1) if 1 < target < 10 else (target, target)
    assert asyncio.run(play(str(target))) == ([], 1.0 + 0.1)
    if low != target:
        assert asyncio.run(play(str(low), f"it is {target}")) == (["Higher."], 0.5 + 0.1 * 0.5)
        assert asyncio.run(play(str(high), str(target))) == (["Lower."], 0.5 + 0.1)


def test_openenv_example_dry_runs_against_its_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """As its README says: start word_server.py, then check the config (here on a free port)."""
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(OPENENV))
    from word_server import WORDS, build_app  # type: ignore[import-not-found]

    from grpo.envs.server import BackgroundServer

    cfg = _orch_of(OPENENV / "rl.yaml")
    with BackgroundServer(build_app()) as address:
        block = cfg.env[0].model_copy(update={"id": f"openenv:http://{address}"})
        check_environments(cfg.model_copy(update={"env": [block]}))
        env = load_environment(block)
        assert env.name == "word" and len(env.examples) == 10
        example = env.examples[1]
        assert "starts with 's'" in example["prompt"]  # seed 1: WORDS[1]

        async def play(*guesses: str) -> float:
            state = await env.reset(example)
            history = [{"role": "assistant", "content": guesses[0]}]
            for guess in guesses[1:]:
                reply = await env.step(history, state)
                history += [*reply.messages, {"role": "assistant", "content": guess}]
            score = await env.score(example, history, state)
            assert not score.failed, score.failure
            return score.reward

        assert asyncio.run(play("plant", WORDS[1])) == 1.0
        assert asyncio.run(play("plant")) == 0.0
