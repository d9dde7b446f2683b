"""The float16 gradient scale: halved on an overflow, doubled after a run of finite steps, bounded."""

from __future__ import annotations

from grpo.trainer.grad_scale import INITIAL_SCALE, MAX_SCALE, MIN_SCALE, Float16GradScale


def test_an_overflow_halves_the_scale_and_restarts_the_count():
    scale = Float16GradScale(growth_interval=3)
    scale.after_step(finite=True)
    scale.after_step(finite=False)
    assert scale.scale == INITIAL_SCALE / 2 and scale.num_finite_steps == 0


def test_a_run_of_finite_steps_doubles_the_scale():
    scale = Float16GradScale(growth_interval=3)
    for _ in range(3):
        scale.after_step(finite=True)
    assert scale.scale == INITIAL_SCALE * 2 and scale.num_finite_steps == 0


def test_the_scale_stays_within_its_bounds():
    low = Float16GradScale(scale=MIN_SCALE)
    low.after_step(finite=False)
    high = Float16GradScale(scale=MAX_SCALE, growth_interval=1)
    high.after_step(finite=True)
    assert low.scale == MIN_SCALE and high.scale == MAX_SCALE


def test_the_state_round_trips():
    scale = Float16GradScale(scale=1024.0, num_finite_steps=7, growth_interval=50)
    restored = Float16GradScale()
    restored.load_state_dict(scale.state_dict())
    assert restored == scale
