"""Noise on the target's hidden states (speculators' EAGLE-3 recipe): applied in training only,
with the configured scale and shape, reproducible under the seed, refused where it means
nothing."""

from __future__ import annotations

import pytest
import torch
from draftsmith.decode.drafters.eagle.head import Eagle3Config, Eagle3Head
from draftsmith.train.config import parse_config
from draftsmith.train.losses import build_loss
from draftsmith.train.objectives.eagle3 import Eagle3Objective
from objective_helpers import bind, sampled_batch
from tiny_models import tiny_llama


def _objective(target: torch.nn.Module) -> Eagle3Objective:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        head = Eagle3Head(Eagle3Config.for_target(target.config))
    return bind(Eagle3Objective(head, target, build_loss("tv"), unroll_steps=2))


def test_noise_reaches_training_only_and_repeats_under_its_seed() -> None:
    target = tiny_llama(num_layers=4)
    batch = sampled_batch(target, rows=2, length=16, seed=1)
    clean, noisy, again, other = (_objective(target) for _ in range(4))
    noisy.set_hidden_state_noise(0.05, "uniform", seed=7)
    again.set_hidden_state_noise(0.05, "uniform", seed=7)
    other.set_hidden_state_noise(0.05, "uniform", seed=8)
    with torch.no_grad():
        losses = [o.compute_loss(batch)[0] for o in (clean, noisy, again, other)]
    assert losses[1] != losses[0]  # training sees the noise
    assert torch.equal(losses[1], losses[2])  # the same seed draws the same noise
    assert losses[3] != losses[1]
    assert clean.evaluate(batch) == noisy.evaluate(batch)  # held-out metrics read clean states


@pytest.mark.parametrize("shape", ["uniform", "gaussian"])
def test_noise_has_the_configured_scale_and_shape(shape: str) -> None:
    objective = _objective(tiny_llama(num_layers=4))
    objective.set_hidden_state_noise(0.05, shape, seed=3)
    features = torch.full((4, 256, 64), 2.0, dtype=torch.float64)
    noise = objective._noisy(features) - features
    if shape == "uniform":  # U(-s, s): |u| <= s, variance s^2 / 3
        assert float(noise.abs().max()) <= 0.05
        assert abs(float(noise.std()) - 0.05 / 3**0.5) < 0.001
    else:  # N(0, s^2)
        assert abs(float(noise.std()) - 0.05) < 0.001
        assert float(noise.abs().max()) > 0.05
    assert abs(float(noise.mean())) < 0.001
    objective.set_hidden_state_noise(0.0)
    assert objective._noisy(features) is features  # off: nothing drawn, nothing added


def test_the_recipe_fields_are_checked() -> None:
    config = parse_config(
        ["--hidden_state_noise", "0.05", "--hidden_state_noise_shape", "gaussian"]
    )
    assert (config.loss.hidden_state_noise, config.loss.hidden_state_noise_shape) == (
        0.05,
        "gaussian",
    )
    with pytest.raises(ValueError, match="hidden_state_noise must be >= 0"):
        parse_config(["--hidden_state_noise", "-0.1"])
    with pytest.raises(ValueError, match="must be one of uniform, gaussian"):
        parse_config(["--hidden_state_noise_shape", "pink"])
    with pytest.raises(ValueError, match="--drafter_kind draft_lm reads none"):
        parse_config(["--hidden_state_noise", "0.05", "--drafter_kind", "draft_lm"])
