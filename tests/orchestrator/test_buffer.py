from __future__ import annotations

from grpo.config.orchestrator import BufferConfig
from grpo.envs import SingleTurnEnv
from grpo.orchestrator.buffer import Buffer
from grpo.orchestrator.types import Group, Rollout


def _env(name: str, num: int) -> SingleTurnEnv:
    return SingleTurnEnv(
        examples=[{"prompt": f"{name} {i}"} for i in range(num)], rewards=[lambda: 0.0], name=name
    )


def _group(example: dict, rewards: list[float]) -> Group:
    rollouts = [Rollout("a", 0, [], [], [], [], 1.0, 0, 0, reward=r) for r in rewards]
    return Group(0, example, 0, rollouts)


def test_sampling_is_reproducible_from_the_seed() -> None:
    a, b = Buffer([_env("a", 50)], BufferConfig(seed=3), 0), Buffer([_env("a", 50)], BufferConfig(seed=3), 0)
    assert [a.sample()[1] for _ in range(20)] == [b.sample()[1] for _ in range(20)]


def test_env_ratios_weight_environments() -> None:
    buffer = Buffer([_env("a", 5), _env("b", 5)], BufferConfig(env_ratios=[0.0, 1.0]), 0)
    assert {buffer.sample()[0] for _ in range(30)} == {1}


def test_duplicate_examples_by_hash_keys_are_sampled_as_one() -> None:
    env = SingleTurnEnv(examples=[{"prompt": "same"}] * 10 + [{"prompt": "other"}], rewards=[lambda: 0.0])
    buffer = Buffer([env], BufferConfig(), 0)
    assert {buffer.sample()[1] for _ in range(50)} == {0, 10}


def test_online_difficulty_filtering_drops_uniform_groups() -> None:
    buffer = Buffer([_env("a", 3)], BufferConfig(online_difficulty_filtering=True), 0)
    ex = {"prompt": "a 0"}
    assert not buffer.keep_group(_group(ex, [1.0, 1.0]))
    assert not buffer.keep_group(_group(ex, [0.0, 0.0]))
    assert buffer.keep_group(_group(ex, [0.0, 1.0]))


def test_failed_rollouts_are_no_rewards_of_0_to_difficulty_filtering_and_the_pools() -> None:
    env = _env("a", 2)
    buffer = Buffer([env], BufferConfig(online_difficulty_filtering=True, hard_threshold=0.7), 0)
    solved = _group(env.examples[0], [1.0, 0.0, 1.0])
    solved.rollouts[1].fail("env a: reset raised RuntimeError")
    assert not buffer.keep_group(solved)  # the finished rollouts all scored 1.0
    buffer.update(0, solved)  # mean 1.0 over the finished ones (not 2/3): not hard
    assert {buffer.sample()[1] for _ in range(20)} == {0, 1}
    broken = _group(env.examples[0], [0.0, 0.0])
    for rollout in broken.rollouts:
        rollout.fail("env a: reset raised RuntimeError")
    assert buffer.keep_group(broken)  # failed, not too hard: the batch drops it and counts it
    buffer.update(0, broken)
    assert {buffer.sample()[1] for _ in range(20)} == {0, 1}


def test_easy_examples_leave_the_pool_and_state_round_trips() -> None:
    env = _env("a", 2)
    buffer = Buffer([env], BufferConfig(easy_threshold=0.9), 0)
    buffer.update(0, _group(env.examples[0], [1.0, 1.0]))
    assert {buffer.sample()[1] for _ in range(20)} == {1}
    restored = Buffer([env], BufferConfig(easy_threshold=0.9), 0)
    restored.load_state(buffer.state())
    assert restored.num_sampled == buffer.num_sampled
    assert restored.sample() == buffer.sample()


def test_easy_fraction_promotes_back_on_load() -> None:
    env = _env("a", 4)
    buffer = Buffer([env], BufferConfig(easy_threshold=0.5), 0)
    for example in env.examples:
        buffer.update(0, _group(example, [1.0]))
    promoted = Buffer([env], BufferConfig(easy_threshold=0.5, easy_fraction=0.5), 0)
    promoted.load_state(buffer.state())
    assert len(promoted.easy[0]) == 2


def test_an_image_prompt_hashes_by_its_pixels_so_pools_survive_a_resume() -> None:
    from PIL import Image

    from grpo.orchestrator.buffer import example_hash

    def example(colour: str) -> dict:
        content = [
            {"type": "image", "image": Image.new("RGB", (4, 4), colour)},
            {"type": "text", "text": "Colour?"},
        ]
        return {"prompt": [{"role": "user", "content": content}]}

    keys = ["task", "prompt"]
    # another PIL object with the same pixels (as a resumed process loads it): the same example
    assert example_hash(example("red"), keys) == example_hash(example("red"), keys)
    assert example_hash(example("red"), keys) != example_hash(example("blue"), keys)


def test_a_dataset_prompts_encoded_image_hashes_by_its_bytes() -> None:
    from PIL import Image

    from grpo.envs.encoded_image import encoded
    from grpo.orchestrator.buffer import example_hash

    def example(colour: str) -> dict:
        image = encoded(Image.new("RGB", (4, 4), colour), None)  # a new object each time, as on resume
        return {"prompt": [{"role": "user", "content": [{"type": "image", "image": image}]}]}

    keys = ["task", "prompt"]
    assert example_hash(example("red"), keys) == example_hash(example("red"), keys)
    assert example_hash(example("red"), keys) != example_hash(example("blue"), keys)
