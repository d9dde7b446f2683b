"""loss.clip_low / clip_high / tis_cap / type: the combinations that cannot do what they say are
refused at load, in one line that names the fix."""

from __future__ import annotations

import pytest

from grpo.config.errors import ConfigError
from grpo.config.loading import validate
from grpo.config.trainer import LossConfig, TrainerConfig


def _refusal(**loss: object) -> str:
    with pytest.raises(ConfigError) as err:
        validate(TrainerConfig, {"model": "m", "output_dir": "out", "loss": loss}, "train.yaml")
    message = str(err.value)
    assert len(message.splitlines()) == 1, message
    return message


def test_defaults_turn_every_knob_off() -> None:
    cfg = LossConfig()
    assert cfg.type == "default" and cfg.clip_low is None and cfg.clip_high is None and cfg.tis_cap is None


def test_clip_bounds_are_ratios_on_either_side_of_one() -> None:
    LossConfig(clip_low=0.8, clip_high=1.28)
    # verl's / TRL's epsilons written where a ratio is expected
    assert "use 0.8 for epsilon 0.2" in _refusal(clip_low=1.2)
    assert "use 1.28 for DAPO's 0.28" in _refusal(clip_high=0.28)


def test_cispo_needs_a_bound_and_takes_no_tis_cap() -> None:
    LossConfig(type="cispo", clip_high=5.0)
    assert "set loss.clip_high" in _refusal(type="cispo")
    assert "set clip_high instead of tis_cap" in _refusal(type="cispo", clip_high=5.0, tis_cap=2.0)


def test_tis_cap_is_for_the_token_ratio_only() -> None:
    LossConfig(tis_cap=2.0)
    LossConfig(ratio_type="sequence_geometric_mean", clip_low=0.9997, clip_high=1.0004)  # GSPO's clip
    assert "lower sequence_clip_high instead" in _refusal(ratio_type="sequence", tis_cap=2.0)
    assert "greater than or equal to 1" in _refusal(tis_cap=0.5)


def test_a_bound_the_token_masks_already_cut_off_is_refused() -> None:
    assert "widen token_mask_high" in _refusal(clip_high=10.0)
    assert "widen token_mask_high" in _refusal(type="cispo", clip_high=8.0)
    assert "widen token_mask_low" in _refusal(clip_low=0.1)
    assert "widen token_mask_high" in _refusal(tis_cap=9.0)
    LossConfig(type="cispo", clip_high=10.0, token_mask_high=float("inf"))
    # a sequence ratio is not what the token masks test: no conflict
    LossConfig(ratio_type="sequence", clip_high=10.0)
