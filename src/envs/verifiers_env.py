"""`- id: <taskset id>`: a verifiers environment (verifiers >= 0.4, its `verifiers.v1` Taskset/Task/Env
API) rolled out by grpo's own token-in/token-out client.

verifiers resolves the id as it does for `vf-eval`: an installed or importable package (`-` read as
`_`) that exports a `Taskset` subclass through `__all__`, and optionally its own `Env` subclass (else
`SingleAgentEnv`). env[].args are the taskset's config fields (validated by its config class), besides
grpo's own `num_examples`, `seed` (shuffle the tasks) and `max_turns`.

What runs where: the taskset's tasks are the examples (TaskData.system_prompt, then its prompt). The
Env's `run(task, agents)` drives each rollout as it does in verifiers, but its one seat is grpo: each
`interaction.turn(message)` hands `message` to grpo as the environment's reply and comes back with the
model's next reply, so no harness, runtime or OpenAI client of verifiers is ever started. Closing the
interaction scores the trace through `Task.score` (its `@vf.reward` functions with their weights and
`@vf.metric` functions, plugged ones and judges included); rewards an Env's `run` records on the trace
count too. Every reward and metric lands in `Score.metrics` under its own name. verifiers' Trace
holds rewards for the whole rollout only (no reward per turn or per message), so `step` returns no
turn reward and orch advantage.turn_credit per_turn sees them all on the last turn (docs/loss.md,
"Multi-turn credit"). Trace-typed `@vf.stop`
predicates end the exchange after the model turn that meets them; Request/Response-typed ones and tool
servers need a harness and are not run. Envs with more than one agent seat are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
from collections.abc import AsyncIterator
from typing import Any

from grpo.envs.base import EnvReply, Example, Message, Score, check_num_examples
from grpo.envs.single_turn import prompt_messages
from grpo.utils.errors import UserError

MIN_VERSION = (0, 4)
"""The first verifiers release with the v1 Taskset API this adapter speaks."""

OWN_ARGS = ("num_examples", "seed", "max_turns")
"""env[].args grpo reads itself; every other arg is a field of the taskset's config."""

DEFAULT_MAX_TURNS = 8
"""Model turns per rollout when neither env[].args.max_turns nor the seat's max_turns says."""

_TERMINATED = object()
"""Sent to a waiting turn() when grpo ends the rollout (its turn limit or a truncated reply)."""


def check_version(installed: str) -> None:
    """A verifiers older than MIN_VERSION has another API: one line naming it and the fix."""
    parts = []
    for piece in installed.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    if tuple(parts) < MIN_VERSION:
        raise UserError(
            f"verifiers {installed} is installed; grpo speaks the Taskset API of verifiers >= 0.4: "
            "pip install 'grpo-rl[verifiers]' (verifiers>=0.4,<0.5)"
        )


def load_verifiers_env(env_id: str, args: dict[str, Any]) -> VerifiersEnv:
    """The environment `- id: env_id` names, its taskset built from `args` (see the module doc)."""
    import verifiers.v1 as vf
    from pydantic import ValidationError
    from verifiers.v1.configs.agent import agent_config_fields

    own = {k: args[k] for k in OWN_ARGS if k in args}
    taskset_args = {k: v for k, v in args.items() if k not in OWN_ARGS}
    where = f"env {env_id}"
    try:
        config = vf.resolve_env_config({"taskset": {**taskset_args, "id": env_id}})
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"] if p != "taskset")
        hint = ""
        if first["type"] == "extra_forbidden":
            fields = sorted({*vf.taskset_config_type(env_id).model_fields, *OWN_ARGS} - {"id", "task"})
            close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
            hint = (f"did you mean {close[0]!r}? " if close else "") + f"its args are: {', '.join(fields)}; "
        raise UserError(f"{where}: arg {key!r}: {first['msg']}; {hint}fix env[].args.{key}") from exc
    if own.get("seed") is not None and (isinstance(own["seed"], bool) or not isinstance(own["seed"], int)):
        raise UserError(f"{where}: seed must be a whole number, got {own['seed']!r}; fix env[].args.seed")
    env = vf.load_environment(config)
    specs = agent_config_fields(env.config)
    seats = list(specs)
    if len(seats) != 1:
        raise UserError(
            f"{where}: its Env {type(env).__name__} has {len(seats)} agent seats ({', '.join(seats)}); grpo "
            "trains one seat and plays no other model: use an env with one seat"
        )
    seat_max_turns = specs[seats[0]].max_turns
    max_turns = own.get("max_turns", seat_max_turns or DEFAULT_MAX_TURNS)
    if type(env) is vf.SingleAgentEnv and "max_turns" not in own:
        max_turns = 1  # a plain taskset's one reply: its harness tools are not run here
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise UserError(f"{where}: max_turns must be a whole number >= 1, got {max_turns!r}; fix env[].args")
    tasks = env.taskset
    if "num_examples" in own:
        check_num_examples(where, own["num_examples"])
    elif not tasks.bounded:
        raise UserError(f"{where}: its taskset is infinite; set env[].args.num_examples")
    if not tasks.bounded:  # take before shuffling: shuffling reads every task
        tasks = tasks.take(own["num_examples"])
    if own.get("seed") is not None:
        tasks = tasks.shuffle(own["seed"])
    if "num_examples" in own:
        tasks = tasks.take(own["num_examples"])
    return VerifiersEnv(env_id, env, seats[0], list(tasks), max_turns)


class VerifiersEnv:
    """grpo's Environment over a verifiers Env and its taskset's tasks."""

    def __init__(self, name: str, env: Any, seat: str, tasks: list[Any], max_turns: int) -> None:
        self.name = name
        self.env = env
        self.seat = seat
        self.tasks = tasks
        self.max_turns = max_turns
        self.examples: list[Example] = []
        for i, task in enumerate(tasks):
            if task.data.prompt is None:
                raise UserError(
                    f"env {name}: task {i} has no prompt (the user opens it); grpo's rollouts start from "
                    "the task's prompt: give every task a prompt"
                )
            prompt = task.data.prompt
            if not isinstance(prompt, str):
                prompt = [m.model_dump(mode="json", exclude_none=True) for m in prompt]
            data = task.data.model_dump(
                mode="json", exclude_defaults=True, exclude={"prompt", "system_prompt"}
            )
            self.examples.append({"prompt": prompt, "task": name, "info": data, "task_index": i})

    def prompt_messages(self, example: Example) -> list[Message]:
        return prompt_messages(example, self.tasks[example["task_index"]].data.system_prompt)

    async def reset(self, example: Example) -> dict[str, Any]:
        episode = Episode(self, self.tasks[example["task_index"]], self.prompt_messages(example))
        await episode.start()
        return {"episode": episode}

    async def step(self, messages: list[Message], state: dict[str, Any]) -> EnvReply:
        episode: Episode = state["episode"]
        return await episode.reply(str(messages[-1].get("content") or ""))

    async def score(self, example: Example, completion: list[Message], state: dict[str, Any]) -> Score:
        return await state["episode"].finish(completion)


class Episode:
    """One rollout: the verifiers Env's `run` in a task of its own, meeting grpo at each turn."""

    def __init__(self, owner: VerifiersEnv, task: Any, opening: list[Message]) -> None:
        self.owner = owner
        self.task = task
        self.opening = opening
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        """From the run to grpo: ("model", messages for the model before its turn), ("done", None)."""
        self.replies: asyncio.Queue[Any] = asyncio.Queue()
        """From grpo to the run: the model's reply text, or _TERMINATED."""
        self.interaction: Interaction | None = None
        self.runner: asyncio.Task[None] | None = None
        self.waiting = False
        """The run waits in turn() for the model's reply."""
        self.num_replies = 0
        """Model replies given to the run."""
        self.finished = False

    async def start(self) -> None:
        """Run the Env until it first asks the model for a turn."""
        import verifiers.v1 as vf

        agents = vf.Agents(self.owner.env.config, make=lambda name, cfg: Seat(self, name, cfg))
        env = self.owner.env

        async def run() -> None:
            try:
                await env.setup(agents)
                await env.run(self.task, agents)
            finally:
                self.events.put_nowait(("done", None))

        self.runner = asyncio.create_task(run())
        if (await self._next()).done:
            raise RuntimeError(f"{type(env).__name__}.run ended without asking the model for a turn")

    async def reply(self, text: str) -> EnvReply:
        """Give the waiting turn the model's reply; the Env's next message, or done."""
        self._answer(text)
        return await self._next()

    def _answer(self, reply: Any) -> None:
        assert self.waiting
        self.waiting = False
        if reply is not _TERMINATED:
            self.num_replies += 1
        self.replies.put_nowait(reply)

    async def _next(self) -> EnvReply:
        kind, messages = await self.events.get()
        if kind == "done":
            self.finished = True
            assert self.runner is not None
            await self.runner  # the Env's own exception fails this rollout
            return EnvReply(messages=[], done=True)
        self.waiting = True
        return EnvReply(messages=messages, done=False)

    async def finish(self, completion: list[Message]) -> Score:
        """Give the run the model's last reply if grpo ended the rollout without a step (one turn, or
        the turn limit), end it (a turn it asks for then comes back terminated) and score its trace;
        never raises."""
        replies = [str(m.get("content") or "") for m in completion if m.get("role") == "assistant"]
        try:
            while not self.finished:
                if self.waiting:
                    pending = replies[self.num_replies :]
                    self._answer(pending[0] if pending else _TERMINATED)
                await self._next()
        except Exception as exc:
            return Score(reward=0.0, failure=f"{type(self.owner.env).__name__}.run raised {exc!r}")
        if self.interaction is None:
            return Score(reward=0.0, failure="the Env never opened an interaction")
        return self.interaction.result()


class Seat:
    """The Env's one agent (`agents.<seat>`), played by grpo."""

    def __init__(self, episode: Episode, name: str, config: Any) -> None:
        self.episode = episode
        self.name = name
        self.config = config
        self.trainable = True

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any, **_resources: Any) -> AsyncIterator[Interaction]:
        if self.episode.interaction is not None:
            raise RuntimeError("grpo plays one interaction per rollout")
        interaction = Interaction(self.episode, self, task)
        self.episode.interaction = interaction
        try:
            yield interaction
        finally:
            await interaction.close()

    async def run(self, task: Any, **_resources: Any) -> Any:
        """SingleAgentEnv's whole rollout: the prompted task's one reply (a harness would go on through
        tool calls; grpo runs none here)."""
        async with self.interaction(task) as interaction:
            await interaction.turn()
        return interaction.trace


class Interaction:
    """verifiers' Interaction, its turns answered by grpo's model; `trace` records the exchange."""

    def __init__(self, episode: Episode, seat: Seat, task: Any) -> None:
        import verifiers.v1 as vf
        from verifiers.v1.state import state_cls

        self.episode = episode
        self.task = task
        self.trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            state=state_cls(type(task))(),
            agent=vf.AgentInfo(config=seat.config, name=seat.name),
        )
        for message in episode.opening:
            self._add(message, sampled=False)
        self.num_turns = 0
        self.over = False
        self.score_error: str | None = None

    def _add(self, message: Message, sampled: bool) -> None:
        import verifiers.v1 as vf
        from pydantic import TypeAdapter

        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        parsed = TypeAdapter(vf.Message).validate_python(message)
        self.trace.nodes.append(vf.MessageNode(parent=parent, message=parsed, sampled=sampled))

    async def turn(self, message: str | list[Any] | None = None) -> Any:
        import verifiers.v1 as vf

        if message is None and self.num_turns > 0:
            raise ValueError("nothing to run a turn on: after the opening reply, turn() takes a user message")
        if self.over or self.num_turns >= self.episode.owner.max_turns:
            self.over = True
            return vf.Segment(messages=[], terminated=True)
        said: list[Message] = []
        if isinstance(message, str):
            said = [{"role": "user", "content": message}]
        elif message is not None:
            said = [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in message]
        for m in said:
            self._add(m, sampled=False)
        self.episode.events.put_nowait(("model", said))
        reply = await self.episode.replies.get()
        if reply is _TERMINATED:
            self.over = True
            return vf.Segment(messages=[], terminated=True)
        self.num_turns += 1
        self._add({"role": "assistant", "content": reply}, sampled=True)
        self.over = await self._stopped()
        return vf.Segment(messages=[vf.AssistantMessage(content=reply)])

    async def _stopped(self) -> bool:
        """Whether a Trace-typed @vf.stop of the task holds after this turn (it names the stop)."""
        import inspect

        import verifiers.v1 as vf
        from verifiers.v1.session import hook_boundary

        for fn in self.task.hooks("stop"):
            if hook_boundary(fn, allow_trace=True) is not vf.Trace:
                continue
            params = inspect.signature(fn).parameters
            result = fn(**{name: self.trace for name in params})
            if inspect.isawaitable(result):
                result = await result
            if result:
                self.trace.stop(fn.__name__)
                return True
        return False

    async def close(self) -> None:
        """Score the trace as verifiers does when an interaction closes."""
        self.over = True
        try:
            await self.task.score(self.trace)
        except Exception as exc:  # a reward function is user code: it fails this rollout only
            cause = exc.__cause__ or exc
            self.score_error = f"scoring raised {type(cause).__name__}: {cause}"

    def result(self) -> Score:
        """The trace's rewards (weighted sum) and every reward's and metric's own value."""
        if self.score_error is not None:
            return Score(reward=0.0, failure=self.score_error)
        unscored = [name for name, r in self.trace.rewards.items() if r is None]
        if unscored:
            return Score(reward=0.0, failure=f"reward {unscored[0]!r} produced no value")
        metrics = {name: float(r.score) for name, r in self.trace.rewards.items() if r is not None}
        metrics |= {name: float(v) for name, v in self.trace.metrics.items() if v is not None}
        return Score(reward=float(self.trace.reward), metrics=metrics)
