"""Validation and test splits, the best checkpoint, early stopping and the EMA of the weights."""

import os

from flax import nnx
import jax
import numpy as np
import pytest

from configs import default
from core import errors
from modes import evaluate
import train
from training import checkpointing
from training import hooks
from training import summaries
from training import run_spec
from tests.helpers.runs import saved
from tests.helpers.build import create
from tests.helpers.build import random_batch
from tests.helpers.runs import assert_resumes_bit_exactly
from tests.helpers.runs import train_until_a_sigterm_at


@pytest.mark.parametrize('best_metric,maximize,values,best_epoch', [
    ('eval/accuracy', True, [0.90, 0.95, 0.93, 0.94], 2),
    ('eval/loss', False, [0.30, 0.20, 0.10, 0.15], 3),
])
def test_the_best_epoch_end_checkpoint_is_kept_besides_the_newest(tmp_path, best_metric,
                                                                   maximize, values, best_epoch):
  state, _ = create(model='mlp')
  checkpoints = checkpointing.Checkpoints(str(tmp_path), best_metric, maximize, max_to_keep=1)
  for epoch, value in enumerate(values, start=1):
    metrics = {'eval/accuracy': 0.5, 'eval/loss': 1.0, best_metric: value}
    checkpoints.save(epoch * 10, state, {'epoch': epoch, 'step_in_epoch': 0,
                                         'steps_per_epoch': 10, 'hooks': {}}, metrics)
  # max_to_keep=1: the newest, and the best.
  assert checkpoints.all_steps() == sorted({best_epoch * 10, len(values) * 10})
  assert checkpoints.best_step() == best_epoch * 10
  assert checkpoints.restore(state, 'best') == best_epoch * 10
  with pytest.raises(errors.CheckpointError) as error:
    checkpoints.restore(state, '7')
  assert error.value.step == '7'


def _loop(state=None, step=0):
  return hooks.Loop(state, steps_per_epoch=10, num_steps=100, step=step)


def _epoch_end(hook, loop, epoch, value):
  loop.step, loop.metrics = epoch * 10, {'eval/accuracy': value}
  hook.after_step(loop)


def test_early_stopping_counts_epochs_without_improvement_across_a_resume():
  early = hooks.EarlyStopping('eval/accuracy', maximize=True, patience=2, min_delta=0.0)
  loop = _loop()
  for epoch, value in enumerate([0.90, 0.95, 0.94], start=1):
    _epoch_end(early, loop, epoch, value)
  assert loop.stop is None  # One epoch without improvement so far.
  # A resumed run continues the count from the checkpoint: one more epoch without improvement.
  resumed, loop = hooks.EarlyStopping('eval/accuracy', True, 2, 0.0), _loop(step=30)
  resumed.load_state_dict(early.state_dict())
  resumed.on_start(loop)
  assert loop.stop is None
  _epoch_end(resumed, loop, 4, 0.945)
  assert 'has not improved' in loop.stop and resumed.ended_run
  # A run resumed after it stopped stops before its first step.
  again, loop = hooks.EarlyStopping('eval/accuracy', True, 2, 0.0), _loop(step=40)
  again.load_state_dict(resumed.state_dict())
  again.on_start(loop)
  assert loop.stop is not None


def test_early_stopping_min_delta_and_lower_is_better():
  early = hooks.EarlyStopping('eval/loss', maximize=False, patience=2, min_delta=0.01)
  loop = _loop()
  for epoch, value in enumerate([0.50, 0.495, 0.492], start=1):  # Better, but by < 0.01.
    loop.step, loop.metrics = epoch * 10, {'eval/loss': value}
    early.after_step(loop)
  assert loop.stop is not None and early.state_dict()['best'] == 0.50


def _tiny_mnist(data_dir, **overrides):
  config = default.get_config()
  config.update({'data_dir': data_dir, 'train_split': 'train[:512]',
                 'eval_split': 'train[512:768]', 'batch_size': 32, 'num_epochs': 2,
                 'checkpoint_every_steps': 1000, 'evaluators': 'loss|accuracy',
                 'log_every_steps': 8, **overrides})
  return config


@pytest.mark.slow
def test_the_test_split_is_scored_once_with_the_best_checkpoint(tfds_data_dir, tmp_path):
  config = _tiny_mnist(tfds_data_dir, test_split='test[:300]', num_epochs=3,
                       evaluators='loss|accuracy|per_class', best_metric='eval/macro_f1',
                       test_evaluators='loss|accuracy|per_class|top_k(3)')
  workdir = str(tmp_path)
  metrics = train.train_and_evaluate(run_spec.resolve(config), workdir)
  written = summaries.read_metrics(workdir)
  by_step = {step: values['eval/macro_f1'] for step, values in written.items()
             if 'eval/macro_f1' in values}
  best_step = max(by_step, key=lambda step: (by_step[step], -step))  # By macro-F1.
  # Written once, at the last step, and equal to an eval of the best checkpoint on that split.
  assert [step for step, values in written.items() if 'test/accuracy' in values] == [48]
  # Each split with its own evaluators.
  assert 'test/top3_accuracy' in metrics and not any(
      'eval/top3_accuracy' in values for values in written.values())
  config.eval_split = config.test_split
  again = evaluate.evaluate_checkpoint(run_spec.resolve(config), workdir, checkpoint='best')
  assert again['eval/accuracy'] == pytest.approx(metrics['test/accuracy'], abs=1e-6)
  assert again['eval/macro_f1'] == pytest.approx(metrics['test/macro_f1'], abs=1e-6)
  assert again['eval/loss'] == pytest.approx(metrics['test/loss'], rel=1e-5)
  assert str(best_step) in os.listdir(os.path.join(workdir, 'checkpoints'))
  assert checkpointing.Checkpoints(workdir, 'eval/macro_f1').best_step() == best_step


def test_ema_after_n_steps_equals_the_formula():
  decay, num_steps = 0.8, 4
  state, train_step = create(model='mlp', ema_decay=decay)
  params = [jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(state.model, nnx.Param)))]
  for step in range(num_steps):
    train_step(state, random_batch(16, seed=step))
    params.append(jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(state.model, nnx.Param))))
  # ema_i = d_i ema_(i-1) + (1 - d_i) p_i, from ema_0 = p_0, with the warm-up
  # d_i = min(d, (1 + i) / (10 + i)).
  def expected_average(*history):
    average = history[0]
    for i in range(1, num_steps + 1):
      warm = min(decay, (1 + i) / (10 + i))
      average = warm * average + (1 - warm) * history[i]
    return average
  expected = jax.tree.map(expected_average, *params)
  averaged = nnx.to_pure_dict(nnx.state(state.eval_model(), nnx.Param))
  jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6),
               averaged, expected)


@pytest.mark.slow
@pytest.mark.parametrize('compute_dtype', ['float32', 'bfloat16'])
def test_a_resumed_run_with_ema_ends_bit_exactly_like_an_uninterrupted_one(tfds_data_dir,
                                                                           tmp_path,
                                                                           compute_dtype):
  options = {'ema_decay': 0.9, 'compute_dtype': compute_dtype}
  whole, halves = str(tmp_path / 'whole'), str(tmp_path / 'halves')
  train.train_and_evaluate(run_spec.resolve(_tiny_mnist(tfds_data_dir, **options)), whole)
  train.train_and_evaluate(run_spec.resolve(_tiny_mnist(tfds_data_dir, num_epochs=1, **options)), halves)
  train.train_and_evaluate(run_spec.resolve(_tiny_mnist(tfds_data_dir, **options)), halves)
  (step, state), (resumed_step, resumed) = saved(whole), saved(halves)
  assert step == resumed_step == 32
  assert any('ema' in name for name in state)
  for name, value in state.items():
    np.testing.assert_array_equal(resumed[name], value, err_msg=name)



@pytest.mark.slow
def test_a_resumed_run_with_every_training_option_ends_bit_exactly(tfds_data_dir, tmp_path,
                                                                    monkeypatch):
  """Mixup and CutMix (off in the last epoch), RandAugment and random erasing, class weights,
  label smoothing, frozen layers, a multiplier, clipping, a step schedule, the EMA and
  fine-tuning from a checkpoint: stopped mid-epoch (as by a SIGTERM) and resumed, the run ends
  in the uninterrupted state."""
  source = str(tmp_path / 'source')
  train.train_and_evaluate(run_spec.resolve(_tiny_mnist(tfds_data_dir, num_epochs=1)), source)
  config = _tiny_mnist(
      tfds_data_dir, preprocess='translate(2)|randaugment(2, 9)|random_erasing(0.5)',
      mixup_alpha=0.2, cutmix_alpha=1.0, unmixed_last_epochs=1, freeze=('conv1',),
      lr_multipliers={'linear2': 2.0}, grad_clip_norm=1.0, schedule='step', ema_decay=0.9,
      init_from=source, init_exclude=('linear2',),
      loss_options={'cross_entropy': {'label_smoothing': 0.1, 'class_weights': 'balanced'}})
  assert_resumes_bit_exactly(config, tmp_path, monkeypatch, 21, 32)


@pytest.mark.slow
def test_two_evaluations_at_their_cadences_log_both_and_resume_bit_exactly(tfds_data_dir, tmp_path,
                                                                          monkeypatch):
  """The eval split every epoch, and 'holdout' (another split, its own evaluators) every 6
  steps: both written at their steps; stopped at step 21 and resumed, the run ends in the state
  and with the metrics of the uninterrupted run."""
  config = _tiny_mnist(tfds_data_dir)
  config.evaluations = {'holdout': {'split': 'test[:100]', 'evaluators': 'accuracy|top_k(2)',
                                    'every': 6}}
  whole, halves = str(tmp_path / 'whole'), str(tmp_path / 'halves')
  train.train_and_evaluate(run_spec.resolve(config), whole)
  metrics = summaries.read_metrics(whole)
  assert [step for step, values in metrics.items() if 'holdout/accuracy' in values] == [
      6, 12, 18, 24, 30]
  assert [step for step, values in metrics.items() if 'eval/accuracy' in values] == [16, 32]
  assert {metrics[6]['holdout/num_examples'], metrics[16]['eval/num_examples']} == {100, 256}
  assert 'holdout/top2_accuracy' in metrics[30] and 'eval/loss' in metrics[32]

  train_until_a_sigterm_at(21, config, halves, monkeypatch)
  train.train_and_evaluate(run_spec.resolve(config), halves)
  (step, state), (resumed_step, resumed) = saved(whole), saved(halves)
  assert step == resumed_step == 32
  for name, value in state.items():
    np.testing.assert_array_equal(resumed[name], value, err_msg=name)
  resumed_metrics = summaries.read_metrics(halves)
  for step in (24, 30, 32):
    assert {name: value for name, value in resumed_metrics[step].items()
            if not name.endswith('examples_per_sec')} == {
                name: value for name, value in metrics[step].items()
                if not name.endswith('examples_per_sec')}, step


@pytest.mark.parametrize('section,key', [
    ({'split': 'test[:10]', 'every': 0}, 'evaluations.holdout.every'),
    ({'split': ''}, 'evaluations.holdout.split'),
    ({'split': 'test', 'evaluators': 'accuracy|nope'}, 'evaluations.holdout.evaluators'),
    ({'split': 'test', 'preprocess': 'flip_lr|resize(3)'}, 'evaluations.holdout.preprocess'),
    ({'split': 'test', 'size': 3}, 'evaluations.holdout.size'),
])
def test_a_bad_evaluation_names_its_key(section, key):
  config = default.get_config()
  config.evaluations = {'holdout': section}
  with pytest.raises(errors.ConfigError) as error:
    run_spec.resolve(config)
  assert error.value.key == key


def test_the_best_metric_names_an_evaluation_that_runs_every_epoch():
  config = default.get_config()
  config.evaluations = {'holdout': {'split': 'test[:10]', 'every': 100}}
  config.best_metric = 'holdout/accuracy'
  with pytest.raises(errors.ConfigError) as error:
    run_spec.resolve(config)
  assert (error.value.key, error.value.value) == ('best_metric', 'holdout/accuracy')
  config.evaluations = {'holdout': {'split': 'test[:10]', 'every': 'epoch'}}
  assert run_spec.resolve(config).best == run_spec.BestMetric('holdout/accuracy', True)
