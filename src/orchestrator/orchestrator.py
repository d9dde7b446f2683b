"""The orchestrator's asyncio main loop.

A launcher task keeps groups (of rollouts_per_example rollouts) in flight at all times, counted against
the groups still needed in total: the current batch's missing groups plus those of every later batch the
current policy may still serve (up to policy + max_async_level), times oversampling_factor. Groups in
flight and finished-but-untaken groups both count, so a batch's leftovers serve the next batch instead
of being launched again, generation for batch n + 1 overlaps training on batch n, and no group is started
that no batch could accept. At most batch_size * oversampling_factor rollouts are in flight at once.
The main coroutine fills batch n with the freshest finished groups first (dropping ones more than
max_off_policy_steps policies old, or that carry no signal), computes advantages, applies filters, packs, and hands the batch to the
sender in a worker thread while generation carries on; with streaming.groups_per_part it does so for
each part of that many groups as soon as they have finished (grpo.transport.batches.parts). With eval
configured, once the last batch is sent it waits for the final policy (max_steps) to reach inference
and evaluates it.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from pathlib import Path
from typing import Any

from grpo.config.orchestrator import OrchestratorConfig
from grpo.envs.base import Environment
from grpo.envs.tool_env import ToolUse
from grpo.inference.types import RolloutClient, SamplingParams
from grpo.orchestrator import checkpoint
from grpo.orchestrator.batching.step_batch import build_batch, pack_metrics, rollout_metrics
from grpo.orchestrator.buffer import Buffer
from grpo.orchestrator.consistency_probe import is_check_step, take_probe
from grpo.orchestrator.env_labels import env_labels
from grpo.orchestrator.eval import evaluate, should_evaluate
from grpo.orchestrator.images.prompt import ImagePrompter
from grpo.orchestrator.reporting.report import Reporter
from grpo.orchestrator.reporting.rollout_log import RolloutLog
from grpo.orchestrator.rollouts.partial import UpdateGate
from grpo.orchestrator.rollouts.rollout import GroupRequest, RolloutRunner
from grpo.orchestrator.rollouts.sampling import request_sampling
from grpo.orchestrator.rollouts.tokenizer import ChatTokenizer
from grpo.orchestrator.rollouts.tool_calls import ToolCallParser
from grpo.orchestrator.scheduler import (
    FinishedGroups,
    PolicyTracker,
    oldest_acceptable,
    required_policy,
    unless_stopped,
)
from grpo.orchestrator.types import Group, Rollout
from grpo.transport.batches.interfaces import BatchSender
from grpo.transport.batches.parts import PartSender
from grpo.transport.batches.probe import ConsistencyProbe
from grpo.utils.logging import get_logger

log = get_logger("orchestrator")


class Orchestrator:
    def __init__(
        self,
        cfg: OrchestratorConfig,
        client: RolloutClient,
        sender: BatchSender,
        run_dir: Path,
        tokenizer: ChatTokenizer,
        envs: list[Environment],
        eval_envs: list[Environment] | None = None,
        stop: asyncio.Event | None = None,
        teacher_client: RolloutClient | None = None,
        image_prompter: ImagePrompter | None = None,
    ) -> None:
        self.cfg = cfg
        self.sender = sender
        self.parts = PartSender(sender, cfg.num_parts_per_step)
        """Sends each step as one batch, or (streaming) as its parts."""
        self.run_dir = run_dir
        self.envs = envs
        self.eval_envs = eval_envs or []
        self.stop = stop or asyncio.Event()
        self.buffer = Buffer(envs, cfg.buffer, cfg.seed)
        self.client = client
        gate = UpdateGate() if cfg.partial_rollouts else None
        self.policy = PolicyTracker(
            run_dir, client, cfg.model.lora_adapter, cfg.model.name or "", update_gate=gate
        )
        tool_envs = [env for env in [*envs, *(eval_envs or [])] if isinstance(env, ToolUse)]
        for env in tool_envs:
            if not tokenizer.shows_tools(env.tools.schemas):
                log.warning(
                    "env %s: the model's chat template ignores tools=, so the model sees the tools only where "
                    "its prompt describes them (system_prompt); a model whose template renders tools "
                    "(Qwen2.5, Qwen3) needs no description",
                    env.name,
                )
        uses_tools = bool(tool_envs)
        self.runner = RolloutRunner(
            client,
            tokenizer,
            self.policy,
            teacher_client,
            gate,
            seq_len=cfg.seq_len,
            tool_parser=ToolCallParser(tokenizer, cfg.tool_call_parser) if uses_tools else None,
            image_prompter=image_prompter,
        )
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.step = 0
        self.num_inflight_target = max(1, math.ceil(cfg.num_groups_per_step * cfg.oversampling_factor))
        self.counters: dict[str, int] = {"num_rollouts_dropped_off_policy": 0, "num_groups_launched": 0}
        self._slots = asyncio.Semaphore(self.num_inflight_target)
        self._done: asyncio.Queue[Group | BaseException] = asyncio.Queue()
        self._finished = FinishedGroups()
        self._inflight: set[asyncio.Task[None]] = set()
        self._group_seconds: list[float] = []
        self._launch_paused = asyncio.Event()
        self._num_pending = 0
        """Groups launched and neither taken into a batch nor rejected yet (in flight or finished)."""
        self._num_taken = 0
        """Groups batch `self.step` has taken so far."""
        self._pending_changed = asyncio.Event()
        """Set when a group is taken or rejected, or the step moves on: the launcher may start another."""

    # ---- launching -------------------------------------------------------------------------

    def _params(self) -> SamplingParams:
        return request_sampling(
            self.cfg.sampling, self.step, self.cfg.max_steps, self.counters["num_groups_launched"]
        )

    async def _run_one(self, req: GroupRequest) -> None:
        started = time.monotonic()
        try:
            group = await self.runner.run_group(req)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surfaced by the collector, which re-raises it
            self._done.put_nowait(exc)
        else:
            self._group_seconds.append(time.monotonic() - started)
            self._done.put_nowait(group)

    async def _launch_forever(self) -> None:
        teacher = self.cfg.teacher_model.model.name if self.cfg.teacher_model is not None else None
        while True:
            await self._slots.acquire()
            while True:
                if self._launch_paused.is_set():
                    await asyncio.sleep(0.01)
                elif self._num_pending >= self._num_wanted():
                    await self._wait_for_demand()
                else:
                    break
            env_index, example_index, example = self.buffer.sample()
            req = GroupRequest(
                env_index,
                self.envs[env_index],
                example_index,
                example,
                self.cfg.rollouts_per_example,
                self._params(),
                self.cfg.buffer.skip_verification,
                teacher,
                resume_across_updates=self.cfg.partial_rollouts,
            )
            self.counters["num_groups_launched"] += 1
            self._num_pending += 1
            task = asyncio.create_task(self._run_one(req))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
            task.add_done_callback(self._resolve_if_cancelled)
            # a callback, not `finally`: a task cancelled before it first runs still frees its slot
            task.add_done_callback(lambda _task: self._slots.release())

    def _num_wanted(self) -> int:
        """Groups worth having pending (in flight, or finished and untaken): oversampling_factor times
        the groups still needed by the batches a group started now may fill, from this one (less what it
        has taken) to the last the current policy may serve."""
        reach = self.policy.version + self.cfg.max_async_level
        if self.cfg.max_steps is not None:
            reach = min(reach, self.cfg.max_steps - 1)
        needed = (reach - self.step + 1) * self.cfg.num_groups_per_step - self._num_taken
        return math.ceil(needed * self.cfg.oversampling_factor) if needed > 0 else 0

    async def _wait_for_demand(self) -> None:
        """Return when a batch took or rejected a group, the step moved on, or the servers run a newer
        policy (a dead policy watcher raises here)."""
        self._pending_changed.clear()
        changed = asyncio.ensure_future(self._pending_changed.wait())
        newer = asyncio.ensure_future(self.policy.wait_for(self.policy.version + 1))
        try:
            await asyncio.wait({changed, newer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
            newer.cancel()
            await asyncio.gather(changed, newer, return_exceptions=True)
        if newer.done() and not newer.cancelled():
            newer.result()

    def _resolve_if_cancelled(self, task: asyncio.Task[None]) -> None:
        """A cancelled group never finishes: it is no longer pending."""
        if task.cancelled():
            self._resolve_pending(1)

    def _resolve_pending(self, num_groups: int) -> None:
        """`num_groups` pending groups were taken into a batch, rejected or cancelled."""
        self._num_pending -= num_groups
        self._pending_changed.set()

    async def _cancel_inflight(self) -> None:
        tasks = list(self._inflight)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- collecting ------------------------------------------------------------------------

    async def _next_done(self) -> Group | None:
        """The next finished group, or None when stop was requested."""
        if not self._done.empty():
            return _group_or_raise(self._done.get_nowait())
        getter = asyncio.ensure_future(self._done.get())
        stopper = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not getter.done():
            getter.cancel()
            return None
        return _group_or_raise(getter.result())

    async def _collect(
        self, step: int, stats: dict[str, float], num_groups: int | None = None
    ) -> list[Group] | None:
        """`num_groups` (default: the step's) finished groups batch `step` keeps; None on stop."""
        num_groups = self.cfg.num_groups_per_step if num_groups is None else num_groups
        groups: list[Group] = []
        while len(groups) < num_groups:
            group = await self._take_freshest(step, stats)
            if group is None:
                return None
            self.buffer.update(group.env_index, group)
            if not self.buffer.keep_group(group):
                stats["buffer/num_difficulty_filtered"] += len(group.rollouts)
                continue
            groups.append(group)
            self._num_taken += 1
        return groups

    async def _take_freshest(self, step: int, stats: dict[str, float]) -> Group | None:
        """The freshest finished group batch `step` may take (waiting for one if none has finished), or
        None when stop was requested. Finished groups too stale for it are dropped and counted: steps
        only grow, so no later batch could take them either."""
        while True:
            while not self._done.empty():
                self._finished.add(_group_or_raise(self._done.get_nowait()))
            stale = self._finished.remove_started_before(
                oldest_acceptable(step, self.cfg.max_off_policy_steps)
            )
            if stale:
                stats["off_policy/num_dropped"] += sum(len(group.rollouts) for group in stale)
                self._resolve_pending(len(stale))
            group = self._finished.pop_freshest()
            if group is not None:
                self._resolve_pending(1)
                return group
            waited = await self._next_done()
            if waited is None:
                return None
            self._finished.add(waited)

    # ---- the step (its batch and metrics: grpo.orchestrator.batching.step_batch) ---------------------

    async def _collect_and_send(
        self, step: int, stats: dict[str, float]
    ) -> tuple[list[Group], list[Rollout], float] | None:
        """Collect batch `step`'s groups and send them: in one batch, or (streaming) in parts of
        streaming.groups_per_part groups, each sent as soon as its groups have finished. Advantages
        are per group and filters per rollout, so the parts hold what the one batch would. Returns
        the groups, their rollouts and the seconds spent building and sending; None on stop."""
        num_parts = self.parts.num_parts
        per_part = self.cfg.streaming.groups_per_part or self.cfg.num_groups_per_step
        groups: list[Group] = []
        rollouts: list[Rollout] = []
        send_seconds = 0.0
        for part in range(num_parts):
            num_groups = min(per_part, self.cfg.num_groups_per_step - len(groups))
            part_groups = await self._collect(step, stats, num_groups)
            if part_groups is None:
                return None
            probe = await self._maybe_probe(step, part_groups) if part == 0 else None
            collected = time.monotonic()
            # advantages, filters and packing are CPU work on finished groups: keep the loop free
            batch, part_rollouts = await asyncio.to_thread(
                build_batch, self.cfg, self.vocab_size, self.policy.version, step, part_groups, stats
            )
            batch.consistency_probe = probe
            await asyncio.to_thread(self.parts.send, batch, part)
            send_seconds += time.monotonic() - collected
            groups += part_groups
            rollouts += part_rollouts
        pack_metrics(stats, rollouts, self.cfg.row_tokens)
        return groups, rollouts, send_seconds

    async def _maybe_probe(self, step: int, groups: list[Group]) -> ConsistencyProbe | None:
        """At a consistency-check step, the probe of the engine running policy `step` (which the
        trainer computes this batch with; grpo.orchestrator.consistency_probe), None otherwise. The
        wait for that policy is the one step of overlap a check costs."""
        check = self.cfg.consistency_check
        if not is_check_step(check, step):
            return None
        reached = await self.policy.reached(step, self._policy_wait_timeout(), self.stop)
        if reached is None:
            return None
        if not reached or self.policy.version != step:
            log.warning(
                "consistency check skipped at step %d: the servers run policy %d, not the trainer's %d",
                step,
                self.policy.version,
                step,
            )
            return None
        return await take_probe(
            check, self.client, self.tokenizer, self.envs, groups, self._params(), self.policy
        )

    async def _maybe_eval(self, step: int, resumed_at: int | None) -> dict[str, float]:
        if (
            self.cfg.eval is None
            or not self.eval_envs
            or not should_evaluate(self.cfg.eval, step, resumed_at)
        ):
            return {}
        self._launch_paused.set()
        if self.cfg.eval.cancel_inflight_rollouts_on_eval:
            await self._cancel_inflight()
        try:
            return await evaluate(self.cfg.eval, self.eval_envs, self.runner, self._params())
        finally:
            self._launch_paused.clear()

    async def _maybe_eval_final_policy(self, reporter: Reporter, resumed_at: int | None) -> None:
        """Once every batch is sent, evaluate policy max_steps and log it as step max_steps.

        Scheduled evaluations run at the start of step n < max_steps, on a policy <= n, so none of them
        saw the final policy: this is its only evaluation. An orchestrator resumed with every batch
        sent skips it like any evaluation right after a resume (skip_eval_on_resume). The final policy
        may never come (the trainer was stopped or died): the wait ends on stop, or after the timeout
        with a warning, since every batch was trained and only the evaluation is missing.
        """
        final = self.cfg.max_steps
        if self.cfg.eval is None or not self.eval_envs or final is None or self.step < final:
            return
        if self.stop.is_set() or (self.cfg.eval.skip_eval_on_resume and resumed_at == final):
            return
        # Leftover rollouts for the last batch can train nothing now; they would only slow the evaluation.
        await self._cancel_inflight()
        timeout = self._policy_wait_timeout()
        log.info("waiting up to %g s for the final policy %d to evaluate it", timeout, final)
        reached = await self.policy.reached(final, timeout, self.stop)
        if reached is None:
            return
        if not reached:
            log.warning(
                "the final policy %d did not reach inference within %g s (it runs policy %d), so it was not "
                "evaluated; the trainer publishes broadcasts/step_%d/ after its last step. To wait longer, "
                "raise ckpt.wait_for_weights_timeout",
                final,
                timeout,
                self.policy.version,
                final,
            )
            return
        evaluation = await unless_stopped(
            evaluate(self.cfg.eval, self.eval_envs, self.runner, self._params()), self.stop
        )
        if evaluation is not None:
            await reporter.log_final_eval(
                final, {**evaluation.result(), "policy/version": self.policy.version}
            )

    def _policy_wait_timeout(self) -> float:
        """Seconds to wait for the policy a resume needs, and for the final policy:
        ckpt.wait_for_weights_timeout when set; else client.timeout, which also bounds the wait for the
        servers."""
        if self.cfg.ckpt.wait_for_weights_timeout is not None:
            return self.cfg.ckpt.wait_for_weights_timeout
        return self.cfg.client.timeout

    async def _resume(self) -> int | None:
        resumed_at = await asyncio.to_thread(
            checkpoint.resolve_resume_step, self.run_dir, self.cfg.ckpt.resume_step
        )
        if resumed_at is None:
            return None
        progress, buffer_state = await asyncio.to_thread(checkpoint.load_checkpoint, self.run_dir, resumed_at)
        if not self.cfg.ckpt.skip_progress:
            self.step = int(progress["step"])
            self.counters.update({k: int(v) for k, v in progress.get("counters", {}).items()})
        if not self.cfg.ckpt.skip_buffer:
            self.buffer.load_state(buffer_state)
        log.info("resumed from orchestrator checkpoint step_%d (next batch %d)", resumed_at, self.step)
        # the servers must run the resumed policy before sampling
        await self.policy.poll_once()
        needed = required_policy(self.step, self.cfg.max_async_level)
        timeout = self._policy_wait_timeout()
        try:
            await asyncio.wait_for(self.policy.wait_for(needed), timeout=timeout)
        except TimeoutError:
            raise TimeoutError(
                f"resumed at batch {self.step}, which needs policy {needed} on the inference servers, but it "
                f"did not arrive within {timeout:g} s (they run policy {self.policy.version}); check that the "
                f"trainer resumed from its step_{needed} checkpoint (or later), or raise ckpt.wait_for_weights_timeout"
            ) from None
        return self.step

    async def run(self) -> None:
        from grpo.utils.gc_heap import startup_heap_frozen

        with startup_heap_frozen():
            await self._run()

    async def _run(self) -> None:
        resumed_at = await self._resume()
        self.policy.start()
        reporter = Reporter(
            self.run_dir, self.cfg.report_to, self.cfg.model_dump(mode="json"), self.cfg.max_steps, self.step
        )
        self._rollout_log = RolloutLog(self.run_dir, self.cfg.rollout_log)
        launcher = asyncio.create_task(self._launch_forever(), name="rollout-launcher")
        try:
            await self._steps(reporter, resumed_at)
            await self._maybe_eval_final_policy(reporter, resumed_at)
        finally:
            launcher.cancel()
            await asyncio.gather(launcher, return_exceptions=True)
            await self._cancel_inflight()
            await self.policy.stop()
            reporter.close(ran_to_the_end=self.cfg.max_steps is not None and self.step >= self.cfg.max_steps)

    async def _steps(self, reporter: Reporter, resumed_at: int | None) -> None:
        while self.cfg.max_steps is None or self.step < self.cfg.max_steps:
            if self.stop.is_set():
                return
            step = self.step
            started = time.monotonic()
            eval_metrics = await self._maybe_eval(step, resumed_at)
            stats: dict[str, float] = {"off_policy/num_dropped": 0, "buffer/num_difficulty_filtered": 0}
            sending = await self._collect_and_send(step, stats)
            if sending is None:
                return
            groups, rollouts, send_seconds = sending
            sent = time.monotonic()
            self.step = step + 1
            self._num_taken = 0
            self._pending_changed.set()
            self.counters["num_rollouts_dropped_off_policy"] += int(stats["off_policy/num_dropped"])
            step_seconds = time.monotonic() - started
            num_tokens = sum(r.num_model_tokens for r in rollouts)
            group_seconds, self._group_seconds = self._group_seconds, []
            metrics = {
                **rollout_metrics(
                    step, groups, rollouts, self.envs, self.policy.version, self.cfg.partial_rollouts
                ),
                **stats,
                **eval_metrics,
                "time/step": step_seconds,
                "time/collect": sent - started - send_seconds,
                "time/send": send_seconds,
                "time/group_mean": statistics.fmean(group_seconds) if group_seconds else 0.0,
                "time/weight_update": self.policy.last_update_seconds,
                "perf/tokens_per_second": num_tokens / step_seconds if step_seconds > 0 else 0.0,
                "perf/num_inflight_groups": len(self._inflight),
            }
            metrics.update(self.client.pool_metrics())
            await reporter.log_step(step, metrics, rollouts)
            await asyncio.to_thread(self._rollout_log.write, step, groups, env_labels(self.envs))
            # After the row: a kill in between leaves a row that the resume cuts, never a checkpoint
            # without its row.
            await self._maybe_checkpoint()

    async def _maybe_checkpoint(self) -> None:
        interval = self.cfg.ckpt.interval
        if interval is None or self.step % interval != 0:
            return
        progress: dict[str, Any] = {"counters": dict(self.counters), "policy_version": self.policy.version}
        await asyncio.to_thread(
            checkpoint.save_checkpoint, self.run_dir, self.step, progress, self.buffer.state(), self.cfg.ckpt
        )


def _group_or_raise(item: Group | BaseException) -> Group:
    """A finished group, or the error its rollout raised (it ends the run)."""
    if isinstance(item, BaseException):
        raise item
    return item
