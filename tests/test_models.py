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


@pytest.mark.parametrize('rate', [0.025, 0.5])
def test_dropout_drops_its_rate_and_keeps_the_mean(rate):
  dropout = models.Dropout(rate=rate, rngs=nnx.Rngs(0))
  ones = jnp.ones((1001, 999))
  first, second = dropout(ones), dropout(ones)
  dropped = first == 0
  # 4.5 standard deviations of a binomial count of 1M draws.
  assert float(dropped.mean()) == pytest.approx(rate, abs=4.5 * np.sqrt(rate * (1 - rate) / 1e6))
  np.testing.assert_allclose(np.unique(first), [0.0, 1 / (1 - rate)], rtol=1e-6)
  # Masks of successive calls, and of neighbouring rows and columns, look independent.
  both = float((dropped & (second == 0)).mean())
  assert both == pytest.approx(rate**2, abs=4.5 * np.sqrt(rate**2 / 1e6))
  for a, b in [(dropped[1:], dropped[:-1]), (dropped[:, 1:], dropped[:, :-1])]:
    assert float((a & b).mean()) == pytest.approx(rate**2, abs=4.5 * np.sqrt(rate**2 / 1e6))
  dropout.eval()
  assert jnp.array_equal(dropout(ones), ones)


def test_dropout_masks_repeat_with_the_seed():
  ones = jnp.ones((64, 64))
  first = models.Dropout(rate=0.5, rngs=nnx.Rngs(3))(ones)
  np.testing.assert_array_equal(models.Dropout(rate=0.5, rngs=nnx.Rngs(3))(ones), first)
  assert not jnp.array_equal(models.Dropout(rate=0.5, rngs=nnx.Rngs(4))(ones), first)


@pytest.mark.parametrize('kernel_size', [(3, 3), (2, 2), (5, 3)])
@pytest.mark.parametrize('channels', [1, 4])
def test_conv_same_and_its_gradients_match_lax_conv(kernel_size, channels):
  x = jax.random.normal(jax.random.key(0), (3, 9, 8, channels))
  kernel = jax.random.normal(jax.random.key(1), (*kernel_size, channels, 5))
  dy = jax.random.normal(jax.random.key(2), (3, 9, 8, 5))
  lax_conv = lambda x, k: jax.lax.conv_general_dilated(
      x, k, (1, 1), 'SAME', dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
  y, vjp = jax.vjp(models.conv_same, x, kernel)
  y_ref, vjp_ref = jax.vjp(lax_conv, x, kernel)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for grad, grad_ref in zip(vjp(dy), vjp_ref(dy)):
    np.testing.assert_allclose(grad, grad_ref, rtol=1e-5, atol=1e-4)


def test_cnn_layers_match_their_plain_flax_counterparts():
  model = _create('cnn')
  x = jax.random.normal(jax.random.key(0), (4, 14, 14, 32))
  plain_conv = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=nnx.Rngs(0))
  nnx.update(plain_conv, nnx.state(model.conv2))
  np.testing.assert_allclose(model.conv2(x), plain_conv(x), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match='strides'):
    models._nnx_conv_same(x, model.conv2.kernel[...], (2, 2), 'SAME', lhs_dilation=(1, 1),
                          rhs_dilation=(1, 1), dimension_numbers=None, feature_group_count=1)
  for shape in [(4, 28, 28, 32), (2, 7, 9, 3)]:  # Odd sizes: 'VALID' drops the last row/column.
    y = jax.random.normal(jax.random.key(1), shape)
    pool = lambda y: nnx.avg_pool(y, window_shape=(2, 2), strides=(2, 2))
    np.testing.assert_allclose(models._avg_pool(y), pool(y), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda y: (models._avg_pool(y) ** 2).sum())(y),
                               jax.grad(lambda y: (pool(y) ** 2).sum())(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('in_features', [1, 3])
def test_conv_batch_norm_equals_batch_norm_of_conv(in_features):
  conv = nnx.Conv(in_features, 8, kernel_size=(3, 3), rngs=nnx.Rngs(0))
  batch_norm = nnx.BatchNorm(8, rngs=nnx.Rngs(0))
  # Non-trivial BatchNorm parameters and statistics, and MNIST-like inputs in [0, 1].
  batch_norm.scale[...] = jax.random.uniform(jax.random.key(1), (8,), minval=0.5, maxval=2)
  batch_norm.bias[...] = jax.random.normal(jax.random.key(2), (8,))
  batch_norm.var[...] = jnp.full((8,), 2.0)
  x = jax.random.uniform(jax.random.key(3), (16, 12, 10, in_features))
  fused_layers = nnx.clone((conv, batch_norm))
  plain_layers = nnx.clone((conv, batch_norm))

  def loss(layers, fused):
    conv, batch_norm = layers
    y = models._conv_batch_norm(conv, batch_norm, x) if fused else batch_norm(conv(x))
    return (jnp.sin(y) * jnp.arange(8)).mean(), y

  (_, y), grads = nnx.value_and_grad(loss, has_aux=True)(fused_layers, True)
  (_, y_ref), grads_ref = nnx.value_and_grad(loss, has_aux=True)(plain_layers, False)
  np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-4)
  for grad, grad_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(grad, grad_ref, rtol=1e-3, atol=1e-5)
  # The running statistics moved, and alike.
  for fused_stat, plain_stat in zip(jax.tree.leaves(nnx.state(fused_layers, nnx.BatchStat)),
                                    jax.tree.leaves(nnx.state(plain_layers, nnx.BatchStat))):
    np.testing.assert_allclose(fused_stat, plain_stat, rtol=1e-5, atol=1e-6)
  assert not np.allclose(fused_layers[1].var[...], 2.0)

  for layers in (fused_layers, plain_layers):
    layers[1].use_running_average = True
  np.testing.assert_allclose(models._conv_batch_norm(*fused_layers, x),
                             plain_layers[1](plain_layers[0](x)), rtol=1e-4, atol=1e-4)
