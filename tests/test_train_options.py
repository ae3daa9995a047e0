"""Label smoothing, gradient accumulation, bfloat16 compute and the profiler (config keys)."""

import glob
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import default
from data_sources import base
import kernels
from kernels import cpu
import models
from training import config_checks
from training import optimizers
import train

_INFO = base.DatasetInfo(name='mnist', image_shape=(28, 28, 1), num_classes=10,
                         num_train_examples=3200, num_eval_examples=100)


def _config(**overrides):
  config = default.get_config()
  config.update(overrides)
  return config


def _setup(**overrides):
  model, optimizer, _, _ = train.create_model_and_optimizer(_config(**overrides), _INFO,
                                                            steps_per_epoch=100)
  return model, optimizer


def _batch(batch_size, seed=0):
  rng = np.random.default_rng(seed)
  return {'image': rng.random((batch_size, 28, 28, 1), dtype=np.float32),
          'label': rng.integers(0, 10, batch_size).astype(np.int32)}


def _params(model):
  return jax.tree.map(np.asarray, nnx.state(model, nnx.Param).to_pure_dict())


def _smoothed_cross_entropy(logits, labels, alpha):
  """Written out: targets (1 - alpha) * one_hot + alpha / K, against log-softmax."""
  num_classes = logits.shape[-1]
  targets = (1 - alpha) * jax.nn.one_hot(labels, num_classes) + alpha / num_classes
  return -(targets * jax.nn.log_softmax(logits)).sum(-1).mean()


def test_label_smoothing_loss_equals_the_formula():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(16, 10)).astype(np.float32) * 3
  labels = rng.integers(0, 10, 16)
  np.testing.assert_allclose(train.train_loss(logits, labels, 0.1),
                             _smoothed_cross_entropy(logits, labels, 0.1), rtol=1e-6)
  np.testing.assert_allclose(train.train_loss(logits, labels),
                             _smoothed_cross_entropy(logits, labels, 0.0), rtol=1e-6)
  assert train.train_loss(logits, labels, 0.1) != pytest.approx(train.train_loss(logits, labels))


def test_a_train_step_descends_the_smoothed_loss():
  # Plain SGD: the new parameters are the old minus the learning rate times the gradient of
  # the smoothed loss on the batch.
  overrides = dict(model='mlp', momentum=0.0, learning_rate=0.5, label_smoothing=0.2)
  model, optimizer = _setup(**overrides, model_options={'mlp': {'hidden_features': (64,)}})
  batch = _batch(32)
  grads = nnx.grad(lambda m: _smoothed_cross_entropy(m(batch['image']), batch['label'], 0.2))(
      model)
  expected = jax.tree.map(lambda p, g: np.asarray(p - 0.5 * g), _params(model),
                          nnx.to_pure_dict(grads))
  logits_before = model(batch['image'])
  metrics = train.train_steps(model, optimizer, None, train.Metrics.empty(),
                              jax.tree.map(lambda x: x[None], batch), 0.2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               _params(model), expected)
  # The logged train loss stays the plain cross-entropy of the logits before the update.
  np.testing.assert_allclose(metrics.compute()['loss'],
                             _smoothed_cross_entropy(logits_before, batch['label'], 0.0),
                             rtol=1e-5)


def test_two_accumulated_batches_of_64_update_as_one_batch_of_128():
  batch = _batch(128, seed=3)
  mlp = dict(model='mlp', model_options={'mlp': {'hidden_features': (128, 128)}})
  model, optimizer = _setup(**mlp, batch_size=128)
  train.train_steps(model, optimizer, None, train.Metrics.empty(),
                    jax.tree.map(lambda x: x[None], batch))
  accumulated, accumulated_optimizer = _setup(**mlp, batch_size=64, grad_accum_steps=2)
  initial = _params(accumulated)
  halves = jax.tree.map(lambda x: x.reshape(2, 64, *x.shape[1:]), batch)
  train.train_steps(accumulated, accumulated_optimizer, None, train.Metrics.empty(),
                    jax.tree.map(lambda x: x[:1], halves))
  # The first micro-batch only accumulates its gradient.
  jax.tree.map(np.testing.assert_array_equal, _params(accumulated), initial)
  train.train_steps(accumulated, accumulated_optimizer, None, train.Metrics.empty(),
                    jax.tree.map(lambda x: x[1:], halves))
  changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), _params(accumulated), initial)
  assert all(jax.tree.leaves(changed))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               _params(accumulated), _params(model))


def test_the_schedule_counts_optimizer_updates():
  config = _config(schedule='cosine', num_epochs=2, grad_accum_steps=4)
  schedule = optimizers.create_learning_rate_schedule(config, steps_per_epoch=100)
  by_step = optimizers.learning_rate_by_step(config, schedule)
  # 200 steps are 50 updates: the cosine is halfway at update 25, i.e. steps 100 to 103.
  assert float(schedule(25)) == pytest.approx(config.learning_rate / 2)
  assert float(by_step(100)) == float(by_step(103)) == float(schedule(25))
  assert float(schedule(50)) == pytest.approx(0.0)


def _float_dtypes(tree):
  return {leaf.dtype for leaf in jax.tree.leaves(nnx.state(tree))
          if jnp.issubdtype(leaf.dtype, jnp.floating)}


def _modules(model, kind):
  return [module for _, module in nnx.iter_graph(model) if isinstance(module, kind)]


@pytest.mark.parametrize('name,image_shape,options', [
    ('cnn', (28, 28, 1), {}),
    ('mlp', (28, 28, 1), {'hidden_features': (32,)}),
    ('resnet', (16, 16, 3), {'widths': (4, 8), 'blocks_per_stage': 1}),
])
def test_every_model_computes_in_bfloat16_with_float32_parameters(name, image_shape, options):
  config = _config(model=name, compute_dtype='bfloat16')
  config.model_options[name] = options
  # Shapes and dtypes only (nnx.eval_shape): nothing is computed.
  model = nnx.eval_shape(lambda: models.create_model(config, image_shape, 10, nnx.Rngs(0)))
  layers = _modules(model, (nnx.Conv, nnx.Linear, nnx.BatchNorm))
  assert layers and all(layer.dtype == jnp.bfloat16 for layer in layers)
  assert _float_dtypes(model) == {jnp.dtype(jnp.float32)}
  # The logits come back in float32, for the loss, predict's softmax and export.
  images = jax.ShapeDtypeStruct((2, *image_shape), jnp.float32)
  assert nnx.eval_shape(lambda model, x: model(x), model, images).dtype == jnp.float32


def test_bfloat16_training_keeps_float32_state_and_lowers_the_loss():
  config = _config(compute_dtype='bfloat16', learning_rate=0.05)
  config.model_options.cnn.update(conv1_features=8, conv2_features=16, hidden_features=32,
                                  dropout_rate=0.0)
  model, optimizer, _, _ = train.create_model_and_optimizer(config, _INFO, steps_per_epoch=100)
  assert isinstance(model.conv1, cpu.Conv)  # The CPU layers on the CPU backend.
  batch = _batch(16)
  assert nnx.jit(lambda conv, x: conv(x))(model.conv1, batch['image']).dtype == jnp.bfloat16
  batches = jax.tree.map(lambda x: x[None], batch)
  losses = [float(train.train_steps(model, optimizer, None, train.Metrics.empty(),
                                    batches).compute()['loss']) for _ in range(4)]
  assert np.isfinite(losses).all() and losses[3] < losses[2] < losses[1] < losses[0], losses
  assert _float_dtypes((model, optimizer)) == {jnp.dtype(jnp.float32)}


def test_cpu_conv_in_bfloat16_equals_the_stock_conv():
  x = jnp.asarray(np.random.default_rng(0).random((4, 8, 8, 3), dtype=np.float32))
  convs = [layer(3, 5, kernel_size=(3, 3), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
           for layer in (nnx.Conv, cpu.Conv)]

  @nnx.jit
  def forward_and_grads(conv):
    loss = lambda conv, x: (conv(x).astype(jnp.float32) ** 2).sum()
    y = conv(x)
    grads = nnx.grad(loss, argnums=(0, 1))(conv, x)
    return y, nnx.to_pure_dict(grads[0]), grads[1]

  (stock_y, stock_grads, stock_dx), (cpu_y, cpu_grads, cpu_dx) = map(forward_and_grads, convs)
  assert stock_y.dtype == cpu_y.dtype == jnp.bfloat16
  assert cpu_grads['kernel'].dtype == jnp.float32  # Parameters and their gradients stay float32.
  # bfloat16 keeps 8 bits of mantissa; the two sum the same products in another order.
  np.testing.assert_allclose(np.float32(cpu_y), np.float32(stock_y), rtol=2e-2, atol=2e-2)
  for cpu_value, stock_value in ((cpu_grads['kernel'], stock_grads['kernel']),
                                 (cpu_dx, stock_dx)):
    np.testing.assert_allclose(np.float32(cpu_value), np.float32(stock_value), rtol=3e-2,
                               atol=0.1)


def test_select_layers_in_float32_is_unchanged_and_refuses_other_dtypes():
  assert kernels.select_layers('auto', 'cpu', 'float32') is kernels.CPU_LAYERS
  with pytest.raises(ValueError, match="Unknown compute_dtype 'float16'"):
    kernels.select_layers('auto', 'cpu', 'float16')


@pytest.mark.parametrize('overrides,message', [
    (dict(label_smoothing=1.0), r'config.label_smoothing=1.0 is invalid: it must be in \[0, 1\)'),
    (dict(grad_accum_steps=0), r'config.grad_accum_steps=0 is invalid: .* integer >= 1'),
    (dict(compute_dtype='float16'), r"Unknown compute_dtype 'float16'.*'bfloat16', 'float32'"),
    (dict(profile_steps=-1), r'config.profile_steps=-1 is invalid'),
])
def test_invalid_values_are_one_line_config_errors(overrides, message):
  with pytest.raises(config_checks.ConfigError, match=message):
    config_checks.check_config(_config(**overrides), data_source=False)


@pytest.mark.parametrize('overrides,message', [
    (dict(grad_accum_steps=101), r'config.grad_accum_steps=101 is more than the 100 steps'),
    (dict(num_epochs=1, profile_steps=96), r'config.profile_steps=96 does not fit in the 100 '
                                           r'steps .* use at most 95'),
])
def test_values_too_large_for_the_data_are_config_errors(overrides, message):
  config = _config(batch_size=32, **overrides)
  with pytest.raises(config_checks.ConfigError, match=message):
    config_checks.check_against_data(config, num_train_examples=3200)
  config.update({key: 1 for key in overrides if key != 'num_epochs'})
  config_checks.check_against_data(config, num_train_examples=3200)


def test_profile_steps_writes_a_trace_for_tensorboard(tfds_data_dir, tmp_path):
  # Epochs of 8 steps in dispatches of 3, 3 and 2: the trace starts at step 6, the first
  # dispatch end after the 5 warm-up steps, and stops at step 8.
  config = _config(data_dir=tfds_data_dir, model='mlp', train_split='train[:256]',
                   eval_split='test[:100]', batch_size=32, num_epochs=2, steps_per_dispatch=3,
                   profile_steps=2, num_misclassified_images=0)
  config.model_options.mlp.hidden_features = (32,)
  workdir = str(tmp_path)
  train.train_and_evaluate(config, workdir)
  traces = glob.glob(os.path.join(workdir, 'plugins', 'profile', '*', '*.xplane.pb'))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0, traces
