from __future__ import annotations

import asyncio
import gc
import math
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from orchestrator_fakes import FakeClient, FakeTrainer, QueueSender, fake_tokenizer, policies_in

from grpo.config.orchestrator import CheckpointConfig, OrchestratorConfig
from grpo.envs import SingleTurnEnv
from grpo.orchestrator.orchestrator import Orchestrator
from grpo.orchestrator.reporting.rollout_log import read_rollouts, rollouts_file
from grpo.orchestrator.types import Group, Rollout
from grpo.transport.batches.filesystem import FilesystemBatchReceiver, FilesystemBatchSender
from grpo.utils.atomic import publish_dir, staging_dir
from grpo.utils.jsonl import read_jsonl


def _env(rewards: list | None = None, prompt: str = "question") -> SingleTurnEnv:
    examples = [{"prompt": f"{prompt} {i}", "answer": "ok"} for i in range(20)]

    def exact(completion: str, answer: str) -> float:
        return float(completion == answer)

    return SingleTurnEnv(examples=examples, rewards=rewards or [exact], name="toy")


def _cfg(**overrides: object) -> OrchestratorConfig:
    base: dict[str, object] = {
        "model": {"name": "base-model"},
        "batch_size": 8,
        "rollouts_per_example": 2,
        "seq_len": 64,
        "max_steps": 5,
    }
    return OrchestratorConfig.model_validate({**base, **overrides})


def _run(
    cfg: OrchestratorConfig,
    run_dir: Path,
    client: FakeClient,
    env: SingleTurnEnv | list[SingleTurnEnv],
    train_seconds: float = 0.0,
):
    sender = QueueSender(maxsize=1)
    trainer = FakeTrainer(sender, run_dir, cfg.max_steps or 0, train_seconds)
    trainer.start()
    envs = env if isinstance(env, list) else [env]
    orch = Orchestrator(cfg, client, sender, run_dir, fake_tokenizer(), envs)
    asyncio.run(asyncio.wait_for(orch.run(), timeout=60))
    trainer.join(timeout=30)
    assert trainer.error is None, trainer.error
    return orch, trainer


@pytest.mark.parametrize("max_async_level", [0, 1, 2])
def test_off_policy_gap_never_exceeds_max_off_policy_steps(tmp_path: Path, max_async_level: int) -> None:
    cfg = _cfg(max_async_level=max_async_level, max_off_policy_steps=max_async_level, oversampling_factor=2.0)
    client = FakeClient(delay=0.005)
    _orch, trainer = _run(cfg, tmp_path, client, _env(), train_seconds=0.02)
    assert [b.step for b in trainer.received] == list(range(5))  # the trainer got every batch it waited for
    for batch in trainer.received:
        for version in policies_in(batch):
            assert 0 <= batch.step - version <= max_async_level, (batch.step, version)
    if max_async_level == 0:
        assert all(policies_in(b) == {b.step} for b in trainer.received)


def test_late_rollouts_train_while_young_enough_and_are_dropped_and_counted_after(tmp_path: Path) -> None:
    # Sampling is on-policy (async 0), but with 3x oversampling each batch leaves groups of its
    # policy in flight; they finish while the trainer trains and arrive one policy late.
    cfg = _cfg(max_async_level=0, max_off_policy_steps=1, oversampling_factor=3.0, max_steps=6)
    orch, trainer = _run(cfg, tmp_path, FakeClient(delay=0.005), _env(), train_seconds=0.05)
    lags = {b.step - v for b in trainer.received for v in policies_in(b)}
    assert lags == {0, 1}  # leftovers trained one policy late, never two
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert max(r["off_policy/max_lag"] for r in records) == 1
    assert orch.counters["num_rollouts_dropped_off_policy"] == sum(
        r["off_policy/num_dropped"] for r in records
    )


def test_rollouts_older_than_max_off_policy_steps_are_dropped_and_counted(tmp_path: Path) -> None:
    # the same leftovers with max_off_policy_steps 0: one policy late is too old, so they are dropped
    cfg = _cfg(max_async_level=0, max_off_policy_steps=0, oversampling_factor=3.0)
    orch, trainer = _run(cfg, tmp_path, FakeClient(delay=0.005), _env(), train_seconds=0.02)
    assert all(policies_in(b) == {b.step} for b in trainer.received)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    dropped = sum(r["off_policy/num_dropped"] for r in records)
    assert dropped > 0 and dropped % cfg.rollouts_per_example == 0  # whole groups
    assert orch.counters["num_rollouts_dropped_off_policy"] == dropped


@pytest.mark.parametrize("max_async_level", [0, 1])
def test_oversampling_launches_against_the_groups_still_needed(tmp_path: Path, max_async_level: int) -> None:
    # A slow trainer (the orchestrator runs ahead) used to launch every batch's share again for each batch
    # still reachable, and a replacement for each stale leftover: 168 groups for 32 (async 1), 116 dropped.
    cfg = _cfg(max_steps=8, max_async_level=max_async_level, oversampling_factor=3.0)
    client = FakeClient(delay=0.005)
    orch, trainer = _run(cfg, tmp_path, client, _env(), train_seconds=0.05)
    assert len(trainer.received) == 8
    per_batch = math.ceil(cfg.num_groups_per_step * cfg.oversampling_factor)
    assert orch.counters["num_groups_launched"] <= per_batch * (cfg.max_steps + max_async_level)


def test_a_batch_takes_the_freshest_finished_groups_first(tmp_path: Path) -> None:
    orch = Orchestrator(
        _cfg(max_async_level=2), FakeClient(), QueueSender(), tmp_path, fake_tokenizer(), [_env()]
    )
    orch.step = 2
    groups = [_group(version) for version in (0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 1)]
    for group in groups:  # in the order they finished
        orch._done.put_nowait(group)
    orch._num_pending = len(groups)
    stats = {"off_policy/num_dropped": 0.0, "buffer/num_difficulty_filtered": 0.0}
    taken = asyncio.run(orch._collect(2, stats))
    assert taken is not None
    assert [g.start_version for g in taken] == [2, 2, 2, 2]
    assert [g.start_version for g in asyncio.run(orch._collect(2, stats))] == [1, 1, 1, 0]
    assert stats["off_policy/num_dropped"] == 0


def _group(version: int) -> Group:
    rollouts = [
        Rollout("toy", 0, [1], [2], [True], [-0.5], 1.0, start_version=version, end_version=version)
        for _ in range(2)
    ]
    return Group(0, {"prompt": "question 0", "answer": "ok"}, 0, rollouts)


def test_servers_switch_to_each_new_policy_adapter(tmp_path: Path) -> None:
    cfg = _cfg(max_async_level=0)
    client = FakeClient()
    _run(cfg, tmp_path, client, _env())
    loaded = [path.rsplit("_", 1)[1] for _name, path in client.loaded]
    # policy 5 (the last step's) may be loaded too when it is published before the loop ends
    assert loaded in (["1", "2", "3", "4"], ["1", "2", "3", "4", "5"])
    assert {name for name, _ in client.loaded} == {"default"}
    assert client.requests[0].model == "base-model"  # policy 0 is the base model
    assert client.requests[-1].model == "default"


def test_raising_reward_fn_does_not_stop_the_run(tmp_path: Path) -> None:
    def broken(completion: str) -> float:
        raise RuntimeError("boom")

    cfg = _cfg(max_steps=2)
    _orch, trainer = _run(cfg, tmp_path, FakeClient(), _env([broken]))
    assert len(trainer.received) == 2
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["failed/num_rollouts"] for r in records] == [8, 8]
    assert all(r["reward/mean"] == 0.0 for r in records)


def test_metrics_have_one_record_per_step(tmp_path: Path) -> None:
    cfg = _cfg(max_steps=3)
    _run(cfg, tmp_path, FakeClient(reply="ok"), _env())
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    first = records[0]
    assert first["reward/mean"] == 1.0 and first["reward/toy/mean"] == 1.0
    assert first["frac_reward_zero_std"] == 1.0
    assert first["completion_len/max"] == 4
    assert 0 < first["packing/efficiency"] <= 1
    # the rollouts of each step are on disk too (grpo.orchestrator.reporting.rollout_log)
    for step in range(3):
        rollouts = read_rollouts(rollouts_file(tmp_path, step))
        assert len(rollouts) == 8 and {r["completion"] for r in rollouts} == {"ok"}
        assert all(r["env"] == "toy" and r["reward"] == 1.0 for r in rollouts)


def test_environments_with_the_same_name_keep_their_own_pools_and_metrics(tmp_path: Path) -> None:
    # Two `toy` environments (like two reverse-text entries with different args): the fake server's
    # "ok" is right for the first and wrong for the second.
    envs = [_env(), _env(rewards=[lambda completion: 0.0], prompt="other")]
    cfg = _cfg(max_steps=3, buffer={"hard_threshold": 0.5})
    orch, _trainer = _run(cfg, tmp_path, FakeClient(reply="ok"), envs)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert {r["reward/toy#0/mean"] for r in records if "reward/toy#0/mean" in r} == {1.0}
    assert {r["reward/toy#1/mean"] for r in records if "reward/toy#1/mean" in r} == {0.0}
    assert not any("reward/toy/mean" in r for r in records)
    assert not orch.buffer.hard[0] and orch.buffer.hard[1]  # only the second's examples are hard
    assert set(orch.buffer.state()["hard"]) == {"toy#0", "toy#1"}


def test_resume_restores_step_and_buffer(tmp_path: Path) -> None:
    cfg = _cfg(max_steps=4, ckpt=CheckpointConfig(interval=2), max_async_level=1)
    first, _ = _run(cfg, tmp_path, FakeClient(), _env())
    assert (tmp_path / "checkpoints" / "orchestrator" / "step_4" / "STABLE").exists()
    sampled_at_4 = first.buffer.num_sampled

    resumed_cfg = _cfg(max_steps=4, ckpt=CheckpointConfig(resume_step=2))
    sender = QueueSender()
    orch = Orchestrator(resumed_cfg, FakeClient(), sender, tmp_path, fake_tokenizer(), [_env()])
    asyncio.run(orch._resume())
    assert orch.step == 2
    assert 0 < orch.buffer.num_sampled < sampled_at_4
    assert orch.policy.version >= 1  # the resumed batch's policy was loaded before sampling


def test_stop_event_ends_the_run(tmp_path: Path) -> None:
    # A run with no step limit, a trainer that keeps publishing, and rollouts always in flight: after
    # stop, run() returns, and nothing it started samples or sends any more.
    cfg = _cfg(max_steps=None, max_async_level=1)
    sender = QueueSender(maxsize=1)
    trainer = FakeTrainer(sender, tmp_path, num_steps=1000, train_seconds=0.01)
    trainer.start()
    client = FakeClient(delay=0.01)

    async def main() -> None:
        stop = asyncio.Event()
        orch = Orchestrator(cfg, client, sender, tmp_path, fake_tokenizer(), [_env()], stop=stop)
        task = asyncio.create_task(orch.run())
        while len(trainer.received) < 3:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, timeout=10)
        assert not orch._inflight
        await asyncio.sleep(0.1)  # the trainer takes a batch still queued, then waits on an empty queue
        num_requests, num_sent = len(client.requests), len(trainer.received) + sender.batches.qsize()
        await asyncio.sleep(0.3)  # the trainer keeps publishing: a leftover launcher would sample on
        assert len(client.requests) == num_requests
        assert len(trainer.received) + sender.batches.qsize() == num_sent

    asyncio.run(main())
    assert [b.step for b in trainer.received] == list(range(len(trainer.received)))


def test_failed_and_non_finite_rewards_are_masked_not_trained_as_zero(tmp_path: Path) -> None:
    import math

    import numpy as np

    examples = [
        {"prompt": f"question {i}", "answer": ["ok", "nan", "raise", "inf"][i % 4]} for i in range(20)
    ]

    def judged(completion: str, answer: str) -> float:
        if answer == "raise":
            raise RuntimeError("boom")
        return {"ok": 1.0, "nan": math.nan, "inf": math.inf}[answer]

    env = SingleTurnEnv(examples=examples, rewards=[judged], name="toy")
    cfg = _cfg(max_steps=2, advantage={"type": "grpo"})
    _orch, trainer = _run(cfg, tmp_path, FakeClient(), env)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    for record, batch in zip(records, trainer.received, strict=True):
        for row in batch.rows:
            assert np.all(np.isfinite(row.advantages)) and np.all(np.isfinite(row.inference_logprobs))
        loss_tokens = sum(int(row.loss_mask.sum()) for row in batch.rows)
        failed = record["failed/num_rollouts"]
        assert failed > 0 and record["masked/num_rollouts"] == failed
        assert loss_tokens == (8 - failed) * 4  # 4 model tokens per rollout; failed ones carry none
        assert record["reward/mean"] == 1.0 and math.isfinite(record["advantage/std"])


def test_a_huge_reward_fails_its_group_and_no_trainer_restart_meets_a_refused_batch(tmp_path: Path) -> None:
    # Rewards of 1e308 (finite) overflow the group mean; before, the batch carried inf advantages,
    # the trainer refused it, and the delivered batch stopped every restart at that step.
    examples = [{"prompt": f"question {i}", "answer": ["ok", "huge"][i % 2]} for i in range(20)]

    def judged(completion: str, answer: str) -> float:
        return {"ok": 1.0, "huge": 1e308}[answer]

    env = SingleTurnEnv(examples=examples, rewards=[judged], name="toy")
    cfg = _cfg(max_steps=3)
    sender = FilesystemBatchSender(tmp_path, max_buffered=1, keep_consumed=10)

    def trainer() -> None:
        receiver = FilesystemBatchReceiver(tmp_path)
        for step in range(3):
            receiver.receive(step, timeout=30)
            final = tmp_path / "broadcasts" / f"step_{step + 1}"
            staged = staging_dir(final)
            (staged / "adapter_config.json").write_text("{}")
            publish_dir(staged, final)

    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _record_errors(trainer, errors), daemon=True)
    thread.start()
    orch = Orchestrator(cfg, FakeClient(), sender, tmp_path, fake_tokenizer(), [env])
    asyncio.run(asyncio.wait_for(orch.run(), timeout=60))
    thread.join(timeout=30)
    assert errors == []
    restarted = FilesystemBatchReceiver(tmp_path)  # a trainer restarted with no checkpoint reads them again
    assert [restarted.receive(step, timeout=1).step for step in range(3)] == [0, 1, 2]
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert sum(r["failed/num_groups"] for r in records) > 0
    assert all(r["failed/num_rollouts"] == 2 * r["failed/num_groups"] for r in records)
    assert all(r["reward/mean"] in (0.0, 1.0) for r in records)  # failed rollouts are not averaged in


def _record_errors(fn: Callable[[], None], errors: list[BaseException]) -> None:
    try:
        fn()
    except BaseException as exc:
        errors.append(exc)


def test_the_loop_runs_with_the_start_up_heap_frozen_and_leaves_it_unfrozen(tmp_path: Path) -> None:
    # Full collections over torch, transformers and the tokenizer took 40% of the orchestrator's
    # time in benchmarks/orchestrator_bench.py (grpo.utils.gc_heap).
    frozen_while_scoring: list[int] = []

    def exact(completion: str, answer: str) -> float:
        frozen_while_scoring.append(gc.get_freeze_count())
        return float(completion == answer)

    _run(_cfg(max_steps=2), tmp_path, FakeClient(reply="ok"), _env([exact]))
    assert frozen_while_scoring and min(frozen_while_scoring) > 1000
    assert gc.get_freeze_count() == 0
