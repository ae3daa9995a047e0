"""Train and eval steps: learning, multi-step dispatch, masked evaluation, optimizers."""

from flax import nnx
import jax
import numpy as np
import optax
import pytest

from data_sources import tfds_source

from data_sources import base

import input_pipeline
import models
from training import optimizers
from training import parallel
import train
from configs import default


_INFO = base.DatasetInfo(name='mnist', image_shape=(28, 28, 1), num_classes=10,
                                   num_train_examples=3200, num_eval_examples=100)


def _setup(**overrides):
  config = default.get_config()
  config.update(overrides)
  model, optimizer, _, _ = train.create_model_and_optimizer(config, _INFO, steps_per_epoch=100)
  return model, optimizer


def _batches(num_steps, batch_size=32, seed=0):
  rng = np.random.default_rng(seed)
  return {'image': rng.random((num_steps, batch_size, 28, 28, 1), dtype=np.float32),
          'label': rng.integers(0, 10, (num_steps, batch_size)).astype(np.int32)}


def _loss_without_dropout(model, batch):
  model.set_attributes(deterministic=True)  # BatchNorm still normalises with batch statistics.
  logits = model(batch['image'][0])
  model.set_attributes(deterministic=False)
  return float(optax.softmax_cross_entropy_with_integer_labels(logits, batch['label'][0]).mean())


def test_compiled_creation_equals_eager_creation():
  config = default.get_config()
  model, optimizer, _, _ = train.create_model_and_optimizer(config, _INFO, 100)
  schedule = optimizers.create_learning_rate_schedule(config, 100)
  eager_model = models.create_model(config, (28, 28, 1), 10, nnx.Rngs(config.seed))
  eager_optimizer = nnx.Optimizer(eager_model, optimizers.create_optimizer(config, schedule),
                                  wrt=nnx.Param)
  compiled, eager = nnx.state((model, optimizer)), nnx.state((eager_model, eager_optimizer))
  # XLA's lowest optimisation level may round the initialisers' float maths differently.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(_key_data(a), _key_data(b), rtol=1e-6,
                                                       atol=1e-7), compiled, eager)


def test_steps_compiled_ahead_are_reused_and_change_nothing():
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kwargs: compiles.append(event)
      if event == '/jax/core/compile/backend_compile_duration' else None)
  # Sizes no other test uses, so that no earlier compile is in the cache.
  config = default.get_config()
  config.update(batch_size=24, eval_batch_size=40, steps_per_dispatch=2)
  mesh = parallel.create_mesh()
  batches = parallel.shard(_batches(2, batch_size=24), mesh, axis=1)
  rng = np.random.default_rng(1)
  split = base.Split(images=rng.integers(0, 256, (70, 28, 28, 1), dtype=np.uint8),
                               labels=rng.integers(0, 10, 70).astype(np.int32))
  eval_batches = [parallel.shard(batch, mesh) for batch in input_pipeline.eval_batches(split, 40)]
  results = []
  with jax.set_mesh(mesh):
    for compile_ahead in (True, False):
      model, optimizer, _, _ = train.create_model_and_optimizer(config, _INFO, 100)
      if compile_ahead:
        compiles.clear()
        train.compile_steps(model, optimizer, None, config, _INFO, mesh)
        assert len(compiles) >= 2  # The train steps and the eval step (and eager zeros).
        compiles.clear()
      metrics = train.train_steps(model, optimizer, None, train.Metrics.empty(), batches,
                                  config.label_smoothing)  # As train.py calls it.
      model.eval()
      train.eval_step(model, train.Metrics.empty(), eval_batches[0])
      model.train()
      if compile_ahead:
        assert not compiles
      eval_metrics, predictions = train.evaluate(model, eval_batches)
      results.append((nnx.state((model, optimizer)), train.summarize(metrics, 'train'),
                      eval_metrics, predictions))
  ahead, plain = results
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(_key_data, ahead[0]),
               jax.tree.map(_key_data, plain[0]))
  assert ahead[1:3] == plain[1:3]
  np.testing.assert_array_equal(ahead[3], plain[3])


def _key_data(x):
  return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def test_train_step_lowers_loss_on_a_fixed_batch(tfds_data_dir):
  config = default.get_config()
  config.data_dir = tfds_data_dir
  split = tfds_source.TfdsSource('mnist', config.data_dir).load_split('train[:128]')
  batch = {'image': split.images[None].astype(np.float32) / 255, 'label': split.labels[None]}
  model, optimizer = _setup()
  before = _loss_without_dropout(model, batch)
  train.train_steps(model, optimizer, None, train.Metrics.empty(), batch)
  after = _loss_without_dropout(model, batch)
  assert after < before - 0.1, (before, after)


def test_k_steps_in_one_dispatch_equal_k_single_steps():
  batches = _batches(3)
  model_a, optimizer_a = _setup()
  metrics_a = train.train_steps(model_a, optimizer_a, None, train.Metrics.empty(), batches)
  model_b, optimizer_b = _setup()
  metrics_b = train.Metrics.empty()
  for i in range(3):
    metrics_b = train.train_steps(model_b, optimizer_b, None, metrics_b,
                                  jax.tree.map(lambda x, i=i: x[i:i + 1], batches))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               nnx.state(model_a, nnx.Param, nnx.BatchStat),
               nnx.state(model_b, nnx.Param, nnx.BatchStat))
  for key, value in train.summarize(metrics_a, 'train').items():
    assert train.summarize(metrics_b, 'train')[key] == pytest.approx(value, rel=1e-5)


def test_masked_padded_eval_equals_eval_of_real_examples_only():
  model, _ = _setup()
  rng = np.random.default_rng(0)
  split = base.Split(images=rng.integers(0, 256, (250, 28, 28, 1), dtype=np.uint8),
                               labels=rng.integers(0, 10, 250).astype(np.int32))
  padded, padded_predictions = train.evaluate(model, input_pipeline.eval_batches(split, 100))
  exact, exact_predictions = train.evaluate(model, input_pipeline.eval_batches(split, 250))
  np.testing.assert_array_equal(padded_predictions, exact_predictions)
  assert padded_predictions.shape == (250,)
  assert padded['eval_num_examples'] == exact['eval_num_examples'] == 250
  assert padded['eval_loss'] == pytest.approx(exact['eval_loss'], rel=1e-5)
  assert padded['eval_accuracy'] == pytest.approx(exact['eval_accuracy'])


def test_evaluate_restores_train_mode():
  model, _ = _setup()
  split = base.Split(images=np.zeros((10, 28, 28, 1), np.uint8),
                               labels=np.zeros(10, np.int32))
  train.evaluate(model, input_pipeline.eval_batches(split, batch_size=10))
  assert not model.dropout1.deterministic and not model.batch_norm1.use_running_average


@pytest.mark.parametrize('name', sorted(optimizers.OPTIMIZERS))
def test_every_optimizer_trains(name):
  model, optimizer = _setup(optimizer=name, learning_rate=0.1 if name == 'sgd' else 1e-3)
  kernels = lambda: [np.array(layer.kernel[...]) for layer in
                     (model.conv1, model.conv2, model.linear1, model.linear2)]
  before = kernels()
  train.train_steps(model, optimizer, None, train.Metrics.empty(), _batches(1))
  for old, new in zip(before, kernels()):
    assert not np.allclose(old, new)


def test_schedules():
  config = default.get_config()
  config.update(num_epochs=10, learning_rate=0.5, warmup_epochs=1.0)
  steps_per_epoch = 10
  for name, start, peak_step, end in (('constant', 0.5, 50, 0.5), ('cosine', 0.5, 0, 0.0),
                                      ('warmup_cosine', 0.0, 10, 0.0)):
    config.schedule = name
    schedule = optimizers.create_learning_rate_schedule(config, steps_per_epoch)
    assert float(schedule(0)) == pytest.approx(start), name
    assert float(schedule(peak_step)) == pytest.approx(0.5), name
    assert float(schedule(100)) == pytest.approx(end, abs=1e-6), name
