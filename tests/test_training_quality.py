"""Validation and test splits, the best checkpoint, early stopping and the EMA of the weights."""

import os

from flax import nnx
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from configs import default
from modes import evaluate
import models
import train
from training import checkpointing
from test_checkpointing import _saved
from test_end_to_end import _scalars


def _mlp_state(tmp_path, **overrides):
  """A small MLP, its optimizer and EMA, and a Checkpointer on tmp_path with `overrides`."""
  config = default.get_config()
  config.update({'model': 'mlp', 'max_checkpoints_to_keep': 1, 'checkpoint_every_steps': 1000,
                 **overrides})
  model = models.create_model(config, (28, 28, 1), 10, nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  ema = checkpointing.create_ema(config, model)
  return config, model, optimizer, ema, checkpointing.Checkpointer(str(tmp_path), config)


@pytest.mark.parametrize('best_metric,values,best_epoch', [
    ('eval_accuracy', [0.90, 0.95, 0.93, 0.94], 2),
    ('eval_loss', [0.30, 0.20, 0.10, 0.15], 3),
])
def test_the_best_epoch_end_checkpoint_is_kept_besides_the_newest(tmp_path, best_metric, values,
                                                                   best_epoch):
  config, model, optimizer, ema, checkpoints = _mlp_state(tmp_path, best_metric=best_metric)
  metrics = (train.Metrics.empty(), train.Metrics.empty())
  for epoch, value in enumerate(values, start=1):
    eval_metrics = {'eval_accuracy': 0.5, 'eval_loss': 1.0, best_metric: value}
    checkpoints.record_eval(epoch, eval_metrics)
    checkpoints.maybe_save(epoch * 10 - 9, epoch * 10, 100, model, optimizer, ema, metrics, 10,
                           eval_metrics)
  assert checkpoints.best == {'value': values[best_epoch - 1], 'epoch': best_epoch}
  # max_checkpoints_to_keep=1: the newest, and the best.
  assert sorted(checkpoints.all_steps()) == sorted({best_epoch * 10, len(values) * 10})
  restored, step = checkpoints.restore_model(model, 'best')
  assert step == best_epoch * 10 and restored is model
  with pytest.raises(Exception, match=r'--checkpoint=7 is not a checkpoint of .*: use best, '
                                      r'latest or one of the steps'):
    checkpoints.restore_model(model, '7')


def test_early_stopping_counts_epochs_without_improvement_across_a_resume(tmp_path):
  config, model, optimizer, ema, checkpoints = _mlp_state(tmp_path, early_stopping_patience=2)
  metrics = (train.Metrics.empty(), train.Metrics.empty())
  stops = []
  for epoch, value in enumerate([0.90, 0.95, 0.94], start=1):
    checkpoints.record_eval(epoch, {'eval_accuracy': value})
    stops.append(train.early_stopped(config, checkpoints, epoch))
    checkpoints.maybe_save(epoch * 10 - 9, epoch * 10, 100, model, optimizer, ema, metrics, 10,
                           {'eval_accuracy': value, 'eval_loss': 1.0})
  assert stops == [False, False, False]  # One epoch without improvement so far.
  # A resumed run continues the count from the checkpoint: one more epoch without improvement.
  resumed = checkpointing.Checkpointer(str(tmp_path), config)
  step, _ = resumed.restore_training(model, optimizer, ema, metrics, 10)
  assert step == 30 and resumed.best == {'value': 0.95, 'epoch': 2}
  resumed.record_eval(4, {'eval_accuracy': 0.945})
  assert train.early_stopped(config, resumed, 4)


def _tiny_mnist(data_dir, **overrides):
  config = default.get_config()
  config.update({'data_dir': data_dir, 'train_split': 'train[:512]',
                 'eval_split': 'train[512:768]', 'batch_size': 32, 'num_epochs': 2,
                 'checkpoint_every_steps': 1000, 'num_misclassified_images': 0,
                 'log_every_steps': 8, **overrides})
  return config


@pytest.mark.slow
def test_the_test_split_is_scored_once_with_the_best_checkpoint(tfds_data_dir, tmp_path):
  config = _tiny_mnist(tfds_data_dir, test_split='test[:300]', num_epochs=3)
  workdir = str(tmp_path)
  metrics = train.train_and_evaluate(config, workdir)
  scalars = _scalars(workdir)
  eval_by_step = dict(scalars['eval_accuracy'])
  best_step = max(eval_by_step, key=lambda step: (eval_by_step[step], -step))
  # Written once, at the last step, and equal to an eval of the best checkpoint on that split.
  assert [step for step, _ in scalars['test_accuracy']] == [48]
  assert scalars['test_num_examples'] == [(48, 300.0)]
  config.eval_split = config.test_split
  again = evaluate.evaluate_checkpoint(config, workdir, checkpoint='best')
  assert again['eval_accuracy'] == pytest.approx(metrics['test_accuracy'], abs=1e-6)
  assert again['eval_loss'] == pytest.approx(metrics['test_loss'], rel=1e-5)
  assert str(best_step) in os.listdir(os.path.join(workdir, 'checkpoints'))


def test_ema_after_n_steps_equals_the_formula(tmp_path):
  decay, num_steps = 0.8, 4
  _, model, optimizer, ema, _ = _mlp_state(tmp_path, ema_decay=decay)
  rng = np.random.default_rng(0)
  params = [jax.tree.map(np.array, nnx.state(model, nnx.Param).to_pure_dict())]
  for _ in range(num_steps):
    batch = {'image': rng.random((1, 16, 28, 28, 1), np.float32),
             'label': rng.integers(0, 10, (1, 16)).astype(np.int32)}
    train.train_steps(model, optimizer, ema, train.Metrics.empty(), batch)
    params.append(jax.tree.map(np.array, nnx.state(model, nnx.Param).to_pure_dict()))
  # ema_N = d^N p_0 + sum_i (1 - d) d^(N - i) p_i
  expected = jax.tree.map(
      lambda *history: decay ** num_steps * history[0] + sum(
          (1 - decay) * decay ** (num_steps - i) * history[i] for i in range(1, num_steps + 1)),
      *params)
  averaged = nnx.state(ema.apply_to(model), nnx.Param).to_pure_dict()
  jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6),
               averaged, expected)


@pytest.mark.slow
def test_a_resumed_run_with_ema_ends_bit_exactly_like_an_uninterrupted_one(tfds_data_dir,
                                                                           tmp_path):
  whole, halves = str(tmp_path / 'whole'), str(tmp_path / 'halves')
  train.train_and_evaluate(_tiny_mnist(tfds_data_dir, ema_decay=0.9), whole)
  train.train_and_evaluate(_tiny_mnist(tfds_data_dir, ema_decay=0.9, num_epochs=1), halves)
  train.train_and_evaluate(_tiny_mnist(tfds_data_dir, ema_decay=0.9), halves)
  (step, state), (resumed_step, resumed) = _saved(whole), _saved(halves)
  assert step == resumed_step == 32
  state.update(_saved_item(whole, step, 'ema'))
  resumed.update(_saved_item(halves, step, 'ema'))
  assert any(name.startswith('ema') for name in state)
  for name, value in state.items():
    np.testing.assert_array_equal(resumed[name], value, err_msg=name)


def _saved_item(workdir, step, item):
  tree = ocp.StandardCheckpointer().restore(os.path.join(workdir, 'checkpoints', str(step), item))
  return {item + jax.tree_util.keystr(path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
