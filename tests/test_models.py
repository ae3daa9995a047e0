"""Models: shapes, parameter counts, the reference CNN's order, options and the registry."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
import models
import train
from benchmarks import reference_mnist
from configs import default
from data_sources import base
from training import config_checks


def _create(name, image_shape=(28, 28, 1), num_classes=10, seed=0, **config_overrides):
  config = default.get_config()
  config.model = name
  config.update(config_overrides)
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


def test_model_options_come_from_the_config():
  config = default.get_config()
  config.model_options.cnn.update(conv1_features=8, conv2_features=16, hidden_features=32,
                                  dropout_rate=0.5)
  model = models.create_model(config, (28, 28, 1), 10, nnx.Rngs(0))
  assert model.conv2.kernel.shape == (3, 3, 8, 16)
  assert model.linear1.kernel.shape == (7 * 7 * 16, 32)
  assert model.dropout1.rate == model.dropout2.rate == 0.5
  config.model = 'mlp'
  config.model_options.mlp.hidden_features = (64, 32, 16)
  model = models.create_model(config, (28, 28, 1), 10, nnx.Rngs(0))
  assert [linear.kernel.shape for linear in model.linears] == [(784, 64), (64, 32), (32, 16),
                                                               (16, 10)]


@pytest.mark.parametrize('cpu_kernels', kernels.CPU_KERNELS)
def test_cnn_is_the_reference_example_function(cpu_kernels):
  """The same parameters give the reference CNN's outputs in eval mode, and in training mode the
  same outputs and gradients when dropout is deterministic (the masks are random by design)."""
  model = _create('cnn', cpu_kernels=cpu_kernels)
  reference = reference_mnist.ReferenceCNN(rngs=nnx.Rngs(1))
  nnx.update(reference, *nnx.state(model, nnx.Param, nnx.BatchStat))
  x = jax.random.uniform(jax.random.key(0), (16, 28, 28, 1))
  for train in (False, True):
    for module in (model, reference):
      module.eval() if not train else module.set_attributes(deterministic=True)
    loss = lambda module: jnp.sin(module(x)).sum()
    np.testing.assert_allclose(model(x), reference(x), rtol=1e-4, atol=1e-4)
    grads, reference_grads = nnx.grad(loss)(model), nnx.grad(loss)(reference)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4),
                 grads, reference_grads)


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


class TinyNet(nnx.Module):
  """What a user adds: one class, built from the injected layers, with one option."""

  def __init__(self, image_shape, num_classes, *, layers, rngs, width=4):
    self.conv = layers.conv(image_shape[-1], width, kernel_size=(3, 3), rngs=rngs)
    self.linear = nnx.Linear(width, num_classes, rngs=rngs)

  def __call__(self, x):
    return self.linear(nnx.relu(self.conv(x)).mean(axis=(1, 2)))


def test_a_model_added_to_the_registry_trains_from_the_config_alone(monkeypatch):
  monkeypatch.setitem(models.MODELS, 'tiny', TinyNet)
  config = default.get_config()
  config.model = 'tiny'
  config.model_options.tiny = {'width': 6}
  config_checks.check_config(config)
  info = base.DatasetInfo(name='random', image_shape=(28, 28, 1), num_classes=10,
                          num_train_examples=96, num_eval_examples=0)
  model, optimizer, _ = train.create_model_and_optimizer(config, info, steps_per_epoch=3)
  assert isinstance(model, TinyNet) and model.conv.kernel.shape == (3, 3, 1, 6)
  # On this CPU backend, 'auto' built it from the CPU layers.
  assert isinstance(model.conv, kernels.cpu.Conv)
  rng = np.random.default_rng(0)
  batches = {'image': rng.random((3, 32, 28, 28, 1), dtype=np.float32),
             'label': rng.integers(0, 10, (3, 32)).astype(np.int32)}
  kernel_before = np.array(model.conv.kernel[...])
  metrics = train.train_steps(model, optimizer, train.Metrics.empty(), batches)
  assert train.summarize(metrics, 'train')['train_num_examples'] == 96
  assert not np.allclose(model.conv.kernel[...], kernel_before)
