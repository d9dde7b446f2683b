"""Dynamic gradient scaling for float16 compute.

A trainer computing in float16 (co-located over a float16 engine: the borrowed weights are used as
vLLM holds them) backpropagates float16 activation gradients, and float16 flushes magnitudes below
6e-8 to zero: small per-token gradients would vanish before they reach the float32 LoRA weights.
The loss is multiplied by a large power of two before backward and the summed gradients divided by
it again before clipping, which leaves every gradient as it was (power-of-two scaling is exact)
unless a product overflowed. An overflow shows up as a non-finite gradient norm; that step is
skipped (the trainer's usual non-finite rule) and the scale halved; after `growth_interval` finite
steps in a row it doubles. bfloat16 and float32 have float32's exponent range and need none of this.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

INITIAL_SCALE = 2.0**16
GROWTH_INTERVAL = 1000
MIN_SCALE = 1.0
MAX_SCALE = 2.0**24


@dataclass
class Float16GradScale:
    scale: float = INITIAL_SCALE
    """What the loss is multiplied by before backward (a power of two)."""
    num_finite_steps: int = 0
    """Finite steps since the scale last changed."""
    growth_interval: int = GROWTH_INTERVAL

    def after_step(self, finite: bool) -> None:
        """Record a step's outcome: halve on an overflow, double after growth_interval finite steps."""
        if not finite:
            self.scale = max(self.scale / 2, MIN_SCALE)
            self.num_finite_steps = 0
            return
        self.num_finite_steps += 1
        if self.num_finite_steps >= self.growth_interval:
            self.scale = min(self.scale * 2, MAX_SCALE)
            self.num_finite_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.num_finite_steps = int(state["num_finite_steps"])
        self.growth_interval = int(state["growth_interval"])
