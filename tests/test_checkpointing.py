"""Checkpoints on real MNIST: exact resume after SIGKILL/SIGTERM, NaN halt, mismatch, eval, export.

Every run trains the CNN (dropout + BatchNorm, so the RNG and batch statistics must resume too)
for 2 epochs of 10 steps on the first 1,280 training images, checkpointing every 3 steps.
"""

import os
import re
import shutil
import signal
import subprocess
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from data_sources import tfds_source
import tensorflow as tf

from training import checkpointing
from training import config_checks
from training import workdirs
from modes import evaluate
from modes import export
import input_pipeline
import models
import train
from configs import default
from test_end_to_end import _scalars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = {'train_split': 'train[:1280]', 'num_epochs': 2, 'checkpoint_every_steps': 3,
             'log_every_steps': 5}
NUM_STEPS = 20


def _command(workdir, data_dir):
  flags = {**OVERRIDES, 'data_dir': data_dir}
  return [sys.executable, 'main.py', '--config=configs/default.py', f'--workdir={workdir}',
          *(f'--config.{key}={value}' for key, value in flags.items())]


def _run(workdir, data_dir):
  result = subprocess.run(_command(workdir, data_dir), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stderr


def _start_and_signal(workdir, data_dir, signum):
  """Starts a run and sends it `signum` right after its first checkpoint; returns its log."""
  process = subprocess.Popen(_command(workdir, data_dir), cwd=ROOT, stderr=subprocess.PIPE,
                             text=True)
  log = []
  for line in process.stderr:
    log.append(line)
    if 'Saved checkpoint at step' in line:
      process.send_signal(signum)
      break
  log.extend(process.stderr)
  process.wait(timeout=300)
  return process.returncode, ''.join(log)


def _saved(workdir, step=None):
  """{leaf name: array} of the model and train items of a checkpoint (default: the latest)."""
  manager = ocp.CheckpointManager(os.path.join(workdir, checkpointing.CHECKPOINT_DIR))
  step = manager.latest_step() if step is None else step
  flat = {}
  for item in ('model', 'train'):
    tree = ocp.StandardCheckpointer().restore(
        os.path.join(manager.directory, str(step), item))
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      flat[item + jax.tree_util.keystr(path)] = np.asarray(
          jax.random.key_data(leaf) if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
          else leaf)
  return step, flat


def _assert_same_state(workdir_a, workdir_b):
  (step_a, state_a), (step_b, state_b) = _saved(workdir_a), _saved(workdir_b)
  assert step_a == step_b == NUM_STEPS
  assert state_a.keys() == state_b.keys()
  for name in state_a:
    np.testing.assert_array_equal(state_a[name], state_b[name], err_msg=name)  # Bitwise.


def _assert_same_metrics(workdir_a, workdir_b):
  """The same (step, value) points in TensorBoard for every metric tag."""
  scalars_a, scalars_b = _scalars(workdir_a), _scalars(workdir_b)
  for tag in ('train_loss', 'train_accuracy', 'learning_rate', 'eval_loss', 'eval_accuracy',
              'eval_num_examples'):
    assert set(scalars_a[tag]) == set(scalars_b[tag]), tag


def _final_eval(workdir):
  scalars = _scalars(workdir)
  return {tag: scalars[tag][-1] for tag in ('eval_loss', 'eval_accuracy', 'eval_num_examples')}


@pytest.fixture(scope='module')
def reference(tfds_data_dir, tmp_path_factory):
  """The workdir of an uninterrupted run."""
  workdir = str(tmp_path_factory.mktemp('reference'))
  log = _run(workdir, tfds_data_dir)
  assert 'No checkpoint in' in log and 'epoch 2/2:' in log
  return workdir


@pytest.mark.slow
def test_sigkill_then_rerun_ends_like_an_uninterrupted_run(reference, tfds_data_dir, tmp_path):
  workdir = str(tmp_path)
  returncode, _ = _start_and_signal(workdir, tfds_data_dir, signal.SIGKILL)
  assert returncode == -signal.SIGKILL
  # What a SIGKILL during Orbax's write of the final checkpoint leaves behind.
  partial = os.path.join(workdir, 'checkpoints', f'{NUM_STEPS}.orbax-checkpoint-tmp', 'model')
  os.makedirs(partial)
  with open(os.path.join(partial, 'half_written'), 'w') as f:
    f.write('x')
  log = _run(workdir, tfds_data_dir)
  restored = int(re.search(r'Restored checkpoint at step (\d+)', log).group(1))
  assert 0 < restored < NUM_STEPS
  assert not os.path.exists(os.path.dirname(partial))  # Removed at the start.
  _assert_same_state(reference, workdir)
  assert _final_eval(workdir) == _final_eval(reference)
  # Points written before the kill and again after the resume agree: nothing contradicts.
  _assert_same_metrics(reference, workdir)


@pytest.mark.slow
def test_sigterm_saves_at_the_current_step_and_rerun_resumes(reference, tfds_data_dir, tmp_path):
  workdir = str(tmp_path)
  returncode, log = _start_and_signal(workdir, tfds_data_dir, signal.SIGTERM)
  assert returncode == 128 + signal.SIGTERM, log[-3000:]
  stopped = int(re.search(r'Received SIGTERM: saved a checkpoint at step (\d+) in .* and '
                          r'stopped\. Rerun the same command to resume\.', log).group(1))
  assert os.path.isdir(os.path.join(workdir, 'checkpoints', str(stopped)))
  assert 'Traceback' not in log
  log = _run(workdir, tfds_data_dir)
  assert f'Restored checkpoint at step {stopped} ' in log
  _assert_same_state(reference, workdir)
  assert _final_eval(workdir) == _final_eval(reference)


def _config(data_dir, **overrides):
  config = default.get_config()
  config.update({**OVERRIDES, 'data_dir': data_dir, **overrides})
  return config


@pytest.mark.slow
def test_nonfinite_loss_halts_and_keeps_the_checkpoints(reference, tfds_data_dir, tmp_path):
  workdir = str(tmp_path / 'run')
  shutil.copytree(reference, workdir)
  before = {step: _saved(workdir, step)[1] for step in (15, 18, 20)}
  # Resumes at step 20, then diverges in the third epoch, before its first checkpoint is due.
  config = _config(tfds_data_dir, num_epochs=3, learning_rate=1e30, checkpoint_every_steps=100)
  with pytest.raises(checkpointing.NonFiniteError,
                     match=r'training loss is (nan|inf) in steps 21-25: halting .* the last good '
                           r'checkpoint is step 20 in .*checkpoints \(kept unchanged\).*'
                           r'config.learning_rate \(now 1e\+30\)'):
    train.train_and_evaluate(config, workdir)
  for step, state in before.items():
    for name, value in _saved(workdir, step)[1].items():
      np.testing.assert_array_equal(value, state[name], err_msg=f'step {step}: {name}')
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['15', '18', '20']


@pytest.mark.slow
@pytest.mark.parametrize('overrides,message', [
    ({'model': 'mlp'}, r'The model state of the checkpoint at step 20 in .*/checkpoints does not '
                       r'match the config \(not in the checkpoint: linears\.0\.bias\.value, .*; '
                       r'only in the checkpoint: batch_norm1\.bias\.value, .* and 14 more\)\. '
                       r'Use the config it was written with'),
    ({'model_options': {'cnn': {'hidden_features': 128}}},
     r'shapes differ \(checkpoint vs config\): linear1\.bias\.value \(256,\) vs \(128,\), '
     r'linear1\.kernel\.value \(3136, 256\) vs \(3136, 128\), linear2\.kernel\.value '
     r'\(256, 10\) vs \(128, 10\)'),
    ({'optimizer': 'adam'}, r'The train state .* \(not in the checkpoint: '
                            r'optimizer\.opt_state\.0\.count\.value, '
                            r'optimizer\.opt_state\.0\.mu\.batch_norm1\.bias\.value, .*; only in '
                            r'the checkpoint: optimizer\.opt_state\.0\.trace\.batch_norm1'),
    ({'batch_size': 64}, r'written with 10 steps per epoch, but config.batch_size=64 .* give 20'),
])
def test_resuming_with_a_different_structure_names_the_difference(
    reference, tfds_data_dir, tmp_path, overrides, message):
  # Without the saved config (a workdir of an older version), which refuses such changes first
  # (tests/test_reliability.py), the checkpoint's own structure is checked.
  workdir = str(tmp_path / 'run')
  shutil.copytree(reference, workdir)
  os.remove(os.path.join(workdir, workdirs.CONFIG_FILE))
  with pytest.raises(config_checks.ConfigError, match=message):
    train.train_and_evaluate(_config(tfds_data_dir, **overrides), workdir)


@pytest.mark.slow
def test_eval_only_reproduces_the_final_eval_of_training(reference, tfds_data_dir):
  result = subprocess.run([*_command(reference, tfds_data_dir), '--mode=eval'], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  final = _final_eval(reference)
  assert final['eval_num_examples'] == (NUM_STEPS, 10_000)
  # Written to TensorBoard at the checkpoint's step, equal to the training run's last eval.
  assert _final_eval(os.path.join(reference, evaluate.EVAL_DIR)) == final
  _, accuracy = final['eval_accuracy']
  assert (f"Checkpoint at step {NUM_STEPS}, mnist 'test': " in result.stdout and
          f'eval_accuracy={accuracy:.4f}' in result.stdout), result.stdout


def test_eval_only_without_checkpoint_says_so(tfds_data_dir, tmp_path):
  with pytest.raises(config_checks.ConfigError, match=r'No checkpoint in .*checkpoints: train '
                                                      r'first with the same --workdir'):
    evaluate.evaluate_checkpoint(_config(tfds_data_dir), str(tmp_path))


@pytest.mark.slow
def test_exported_saved_model_predicts_like_the_jax_model(reference, tfds_data_dir):
  config = _config(tfds_data_dir)
  path = export.export_saved_model(config, reference)
  assert path == os.path.join(reference, 'export')
  source = tfds_source.TfdsSource('mnist', config.data_dir)
  model, step = checkpointing.load_model(config, reference, source.info(config))
  assert step == NUM_STEPS
  images = input_pipeline.eval_batches(
      source.load_split('test[:100]'), batch_size=100)[0]['image']
  loaded = tf.saved_model.load(path)
  served = loaded.signatures['serving_default'](images=tf.constant(images))['output_0']
  np.testing.assert_allclose(served.numpy(), model(images), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(loaded.predict(images).numpy(), model(images), rtol=1e-4, atol=1e-4)


def test_a_nonfinite_state_is_never_saved(tmp_path):
  config = default.get_config()
  config.model = 'mlp'
  model = models.create_model(config, (28, 28, 1), 10, nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  model.linears[-1].bias[...] = jnp.full(10, jnp.nan)
  checkpoints = checkpointing.Checkpointer(str(tmp_path), config)
  with pytest.raises(checkpointing.NonFiniteError, match=r'training state is not finite at step '
                                                         r'500: .*no checkpoint was saved before'):
    checkpoints.maybe_save(1, 500, 1000, model, optimizer, None,
                           (train.Metrics.empty(), train.Metrics.empty()), steps_per_epoch=100)
  assert checkpoints.latest_step() is None
