"""`env[].args` of an `openenv:` block: how grpo plays a running OpenEnv server (grpo.envs.openenv_env,
built by grpo.envs.openenv_load).

```yaml
env:
  - id: "openenv:http://127.0.0.1:8001"
    args: {num_examples: 8, max_turns: 3, action_field: message, max_sessions: 8}
```
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from grpo.config.base import StrictModel


class OpenEnvArgs(StrictModel):
    num_examples: int = Field(8, ge=1)
    """Examples to train on: the first observations of reset(seed=seed), reset(seed=seed+1), ...
    (one example is one reset, fetched at load)."""

    seed: int = Field(0, ge=0)
    """Seed of the first example's reset; each rollout resets with its example's seed again, so the
    environment must honour reset's seed (a rollout whose reset shows another observation fails)."""

    reset_args: dict[str, Any] = Field(default_factory=dict)
    """Further keyword arguments of every reset (what the environment's reset() takes besides seed)."""

    max_turns: int = Field(4, ge=1)
    """Model turns per episode; it ends earlier when the server says done."""

    action_field: str = "message"
    """Action field the model's reply goes into (`message` in OpenEnv's echo and TextArena
    environments); checked against the server's action schema at load."""

    action_args: dict[str, Any] = Field(default_factory=dict)
    """Other action fields, the same in every step (the schema's required ones must be given)."""

    observation_field: str | None = None
    """Observation field whose text the model reads (the prompt after reset, the next user message
    after a step); null takes the observation's only string field (`echoed_message` in the echo
    environment, `prompt` in TextArena's) and refuses an observation with several."""

    system_prompt: str | None = None
    """System message put before every prompt."""

    reward: Literal["sum", "last"] = "sum"
    """An episode's reward: the sum of its step rewards (its return; a step's null reward counts 0),
    each step's also the reward of the model turn it reacts to (orch advantage.turn_credit per_turn);
    or the last step's, on the last turn, for servers whose reward is already cumulative."""

    max_sessions: int = Field(1, ge=1)
    """Episodes open on the server at once (one WebSocket session each): its max_concurrent_envs
    (OpenEnv's default is 1; more sessions than it allows would fail with CAPACITY_REACHED)."""

    api_key_var: str = "OPENENV_API_KEY"
    """Environment variable whose token is sent as `Authorization: Bearer` (to a proxy or a private
    Space in front of the server); a server that is not this machine is refused without one."""
