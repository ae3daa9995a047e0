"""Model shapes, parameter counts, train/eval behaviour and model selection."""

from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import models


def _create(name, image_shape=(28, 28, 1), num_classes=10, seed=0):
  config = ml_collections.ConfigDict({'model': name})
  return models.create_model(config, image_shape, num_classes, nnx.Rngs(seed))


def _count(model, kind):
  return sum(np.size(x) for x in jax.tree.leaves(nnx.state(model, kind)))


@pytest.mark.parametrize('name', ['cnn', 'mlp'])
@pytest.mark.parametrize('image_shape,num_classes', [((28, 28, 1), 10), ((32, 32, 3), 7)])
def test_output_shape(name, image_shape, num_classes):
  model = _create(name, image_shape, num_classes)
  logits = model(jnp.zeros((5, *image_shape)))
  assert logits.shape == (5, num_classes)
  assert logits.dtype == jnp.float32


def test_cnn_parameter_count():
  model = _create('cnn')
  # conv1 320 + bn1 64 + conv2 18,496 + bn2 128 + dense 802,816+256 + dense 2,560+10.
  assert _count(model, nnx.Param) == 824_650
  # Running mean and variance of both BatchNorms (not trained by the optimizer).
  assert _count(model, nnx.BatchStat) == 192


def test_mlp_parameter_count():
  assert _count(_create('mlp'), nnx.Param) == (784 * 512 + 512) + (512 * 512 + 512) + (512 * 10 + 10)


def test_cnn_train_mode_is_stochastic_and_updates_batch_stats():
  model = _create('cnn')
  x = jax.random.uniform(jax.random.key(1), (8, 28, 28, 1))
  mean_before = model.batch_norm1.mean[...].copy()
  first, second = model(x), model(x)
  assert not jnp.allclose(first, second), 'dropout should draw new masks in train mode'
  assert not jnp.allclose(model.batch_norm1.mean[...], mean_before)


def test_cnn_eval_mode_is_deterministic_and_freezes_batch_stats():
  model = _create('cnn')
  model.eval()
  x = jax.random.uniform(jax.random.key(1), (8, 28, 28, 1))
  mean_before = model.batch_norm1.mean[...].copy()
  np.testing.assert_array_equal(model(x), model(x))
  np.testing.assert_array_equal(model.batch_norm1.mean[...], mean_before)


def test_unknown_model_lists_valid_names():
  with pytest.raises(ValueError, match=r"Unknown model 'resnet'.*\['cnn', 'mlp'\]"):
    _create('resnet')


def test_dropout_drops_its_rate_and_keeps_the_mean():
  dropout = models.Dropout(rate=0.025, rngs=nnx.Rngs(0))
  ones = jnp.ones((1001, 999))  # An odd size: the mask is cut from pairs of 16-bit draws.
  first, second = dropout(ones), dropout(ones)
  assert float((first == 0).mean()) == pytest.approx(0.025, abs=1e-3)
  assert float(first.mean()) == pytest.approx(1.0, abs=2e-3)
  np.testing.assert_allclose(np.unique(first), [0.0, 1 / 0.975], rtol=1e-6)
  assert not jnp.array_equal(first, second)
  dropout.eval()
  assert jnp.array_equal(dropout(ones), ones)
