"""Temperature scaling and test-time augmentation: the fitted temperature is the NLL's minimum,
and the scored model keeps the classes (a trained model's: tests/test_predict.py)."""

import json

from flax import nnx
import jax
import numpy as np
import pytest

from configs import default
from core import errors
from training import calibration
from training import run_spec


def _overconfident(num=2000, classes=10, seed=0):
  """Logits right 70% of the time, scaled 4x: far more confident than 70%."""
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, classes, num)
  logits = rng.normal(size=(num, classes))
  right = rng.random(num) < 0.7
  logits[np.arange(num), np.where(right, labels, (labels + 1) % classes)] += 2.5
  return (4 * logits).astype(np.float32), labels


def _numpy_nll(logits, labels, temperature):
  scaled = logits.astype(np.float64) / temperature
  scaled -= scaled.max(axis=1, keepdims=True)
  log_probs = scaled - np.log(np.exp(scaled).sum(axis=1, keepdims=True))
  return -log_probs[np.arange(len(labels)), labels].mean()


def test_the_fitted_temperature_is_the_minimum_of_the_nll(tmp_path):
  logits, labels = _overconfident()
  fit = calibration.fit_temperature(logits, labels)
  grid = np.geomspace(0.25, 16, 2401)  # Steps of 0.17%.
  best = grid[np.argmin([_numpy_nll(logits, labels, t) for t in grid])]
  assert fit.temperature == pytest.approx(best, rel=0.005)
  assert fit.temperature > 1  # Overconfident logits are softened.
  assert fit.nll_before == pytest.approx(_numpy_nll(logits, labels, 1.0), rel=1e-5)
  assert fit.nll_after == pytest.approx(_numpy_nll(logits, labels, fit.temperature), rel=1e-5)
  assert fit.nll_after < fit.nll_before
  assert calibration.saved_temperature(str(tmp_path)) == 1.0  # None fitted yet.
  path = calibration.save_temperature(str(tmp_path), fit, split='test', step=7)
  assert calibration.saved_temperature(str(tmp_path)) == fit.temperature
  assert calibration.saved_temperature(str(tmp_path), applied=False) == 1.0  # Turned off.
  with open(path, encoding='utf-8') as file:
    assert json.load(file)['step'] == 7


class _Linear(nnx.Module):
  """A tiny classifier of 4x4x1 images: a left-right mirror changes its logits."""

  def __init__(self):
    self.linear = nnx.Linear(16, 3, rngs=nnx.Rngs(0))

  def __call__(self, images):
    return self.linear(images.reshape(len(images), -1))


def test_scored_model_divides_by_the_temperature_and_averages_the_mirror():
  model = _Linear()
  images = jax.random.normal(jax.random.key(1), (6, 4, 4, 1))
  logits = np.asarray(model(images))
  mirrored = np.asarray(model(images[:, :, ::-1]))
  softmax = lambda values: np.asarray(jax.nn.softmax(values))
  assert calibration.scored(model) is model  # Nothing to apply: the model itself.
  scaled = softmax(calibration.scored(model, 2.5)(images))
  np.testing.assert_allclose(scaled, softmax(logits / 2.5), rtol=1e-5)
  np.testing.assert_array_equal(scaled.argmax(axis=1), logits.argmax(axis=1))
  averaged = softmax(calibration.scored(model, 2.5, 'flip')(images))
  np.testing.assert_allclose(
      averaged, (softmax(logits / 2.5) + softmax(mirrored / 2.5)) / 2, rtol=1e-5)
  assert not np.allclose(averaged, scaled)  # The mirror counted.


def test_resolve_refuses_an_unknown_test_time_augmentation():
  config = default.get_config()
  config.eval_tta = 'mirror'
  with pytest.raises(errors.ConfigError) as error:
    run_spec.resolve(config)
  assert (error.value.key, error.value.value) == ('eval_tta', 'mirror')
  config.eval_tta = 'flip'
  assert run_spec.resolve(config).eval_tta == 'flip'
