"""Train and eval steps: learning, multi-step dispatch, masked evaluation, optimizers."""

from flax import nnx
import jax
import numpy as np
import optax
import pytest

import input_pipeline
import models
import optimizers
import train
from configs import default


def _setup(**overrides):
  config = default.get_config()
  config.update(overrides)
  model = models.create_model(config, (28, 28, 1), 10, nnx.Rngs(config.seed))
  schedule = optimizers.create_learning_rate_schedule(config, steps_per_epoch=100)
  optimizer = nnx.Optimizer(model, optimizers.create_optimizer(config, schedule), wrt=nnx.Param)
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


def test_train_step_lowers_loss_on_a_fixed_batch(tfds_data_dir):
  config = default.get_config()
  config.data_dir = tfds_data_dir
  split = input_pipeline.load_split(input_pipeline.prepared_builder(config), 'train[:128]')
  batch = {'image': split.images[None].astype(np.float32) / 255, 'label': split.labels[None]}
  model, optimizer = _setup()
  before = _loss_without_dropout(model, batch)
  train.train_steps(model, optimizer, train.Metrics.empty(), batch)
  after = _loss_without_dropout(model, batch)
  assert after < before - 0.1, (before, after)


def test_k_steps_in_one_dispatch_equal_k_single_steps():
  batches = _batches(3)
  model_a, optimizer_a = _setup()
  metrics_a = train.train_steps(model_a, optimizer_a, train.Metrics.empty(), batches)
  model_b, optimizer_b = _setup()
  metrics_b = train.Metrics.empty()
  for i in range(3):
    metrics_b = train.train_steps(model_b, optimizer_b, metrics_b,
                                  jax.tree.map(lambda x, i=i: x[i:i + 1], batches))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               nnx.state(model_a, nnx.Param, nnx.BatchStat),
               nnx.state(model_b, nnx.Param, nnx.BatchStat))
  for key, value in train.summarize(metrics_a, 'train').items():
    assert train.summarize(metrics_b, 'train')[key] == pytest.approx(value, rel=1e-5)


def test_masked_padded_eval_equals_eval_of_real_examples_only():
  model, _ = _setup()
  rng = np.random.default_rng(0)
  split = input_pipeline.Split(images=rng.integers(0, 256, (250, 28, 28, 1), dtype=np.uint8),
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
  split = input_pipeline.Split(images=np.zeros((10, 28, 28, 1), np.uint8),
                               labels=np.zeros(10, np.int32))
  train.evaluate(model, input_pipeline.eval_batches(split, batch_size=10))
  assert not model.dropout1.deterministic and not model.batch_norm1.use_running_average


@pytest.mark.parametrize('name', sorted(optimizers.OPTIMIZERS))
def test_every_optimizer_trains(name):
  model, optimizer = _setup(optimizer=name, learning_rate=0.1 if name == 'sgd' else 1e-3)
  kernels = lambda: [np.array(layer.kernel[...]) for layer in
                     (model.conv1, model.conv2, model.linear1, model.linear2)]
  before = kernels()
  train.train_steps(model, optimizer, train.Metrics.empty(), _batches(1))
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
