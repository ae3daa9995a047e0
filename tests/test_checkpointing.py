"""Checkpoints on real MNIST: exact resume after SIGKILL/SIGTERM, NaN halt, mismatch, eval.

Every run trains the CNN (dropout + BatchNorm, so the RNG and batch statistics must resume too)
for 2 epochs of 10 steps on the first 1,280 training images, checkpointing every 3 steps, and
evaluates it on the first 1,000 test images after each epoch (all 10,000 cost more than the 10
training steps of 128: 10,000 forward passes against about 3 x 1,280).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys

from flax import nnx
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import default
from core import errors
from modes import evaluate
import train
from training import checkpointing
from training import hooks
from training import summaries
from training import workdirs
from training import run_spec
from tests.helpers.build import create
from tests.helpers.runs import saved

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = {'train_split': 'train[:1280]', 'eval_split': 'test[:1000]', 'num_epochs': 2,
             'checkpoint_every_steps': 3, 'log_every_steps': 5}
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



def _assert_same_state(workdir_a, workdir_b):
  (step_a, state_a), (step_b, state_b) = saved(workdir_a), saved(workdir_b)
  assert step_a == step_b == NUM_STEPS
  assert state_a.keys() == state_b.keys()
  for name in state_a:
    np.testing.assert_array_equal(state_a[name], state_b[name], err_msg=name)  # Bitwise.


def _assert_same_metrics(workdir_a, workdir_b):
  """The same values at every step for every metric (a resumed run writes some steps again:
  the last write of a step counts)."""
  metrics_a, metrics_b = summaries.read_metrics(workdir_a), summaries.read_metrics(workdir_b)
  assert metrics_a.keys() == metrics_b.keys()
  for step, values in metrics_a.items():
    for name in ('train/loss', 'train/accuracy', 'learning_rate', 'eval/loss', 'eval/accuracy'):
      assert values.get(name) == metrics_b[step].get(name), (step, name)


def _final_eval(workdir):
  return summaries.read_metrics(workdir)[NUM_STEPS]['eval/accuracy']


@pytest.fixture(scope='module')
def reference(tfds_data_dir, tmp_path_factory):
  """The workdir of an uninterrupted run."""
  workdir = str(tmp_path_factory.mktemp('reference'))
  _run(workdir, tfds_data_dir)
  evaluated = [step for step, values in summaries.read_metrics(workdir).items()
               if 'eval/accuracy' in values]
  assert evaluated == [NUM_STEPS // 2, NUM_STEPS]  # Both epochs, each with its eval.
  return workdir


@pytest.mark.slow
def test_sigterm_and_sigkill_then_reruns_end_like_an_uninterrupted_run(reference, tfds_data_dir,
                                                                       tmp_path):
  """A SIGTERM saves at the current step and stops; the rerun resumes there and is killed
  (SIGKILL) after its next checkpoint, leaving a partial save; the next rerun removes it,
  resumes and ends like the uninterrupted run, bit for bit (one chain: each run is a main.py
  start)."""
  workdir = str(tmp_path)
  returncode, log = _start_and_signal(workdir, tfds_data_dir, signal.SIGTERM)
  assert returncode == 128 + signal.SIGTERM, log[-3000:]
  stopped = int(re.search(r'Received SIGTERM: saved a checkpoint at step (\d+) in .* and '
                          r'stopped\. Rerun the same command to resume\.', log).group(1))
  assert os.path.isdir(os.path.join(workdir, 'checkpoints', str(stopped)))
  assert 'Traceback' not in log
  returncode, log = _start_and_signal(workdir, tfds_data_dir, signal.SIGKILL)
  assert returncode == -signal.SIGKILL
  assert f'Restored checkpoint at step {stopped} ' in log
  # What a SIGKILL during Orbax's write of the final checkpoint leaves behind.
  partial = os.path.join(workdir, 'checkpoints', f'{NUM_STEPS}.orbax-checkpoint-tmp', 'state')
  os.makedirs(partial)
  with open(os.path.join(partial, 'half_written'), 'w') as f:
    f.write('x')
  log = _run(workdir, tfds_data_dir)
  restored = int(re.search(r'Restored checkpoint at step (\d+)', log).group(1))
  assert stopped < restored < NUM_STEPS
  assert not os.path.exists(os.path.dirname(partial))  # Removed at the start.
  _assert_same_state(reference, workdir)
  assert _final_eval(workdir) == _final_eval(reference)
  # Points written before the stops and again after the resumes agree: nothing contradicts.
  _assert_same_metrics(reference, workdir)


def _config(data_dir, **overrides):
  config = default.get_config()
  config.update({**OVERRIDES, 'data_dir': data_dir, **overrides})
  return config


@pytest.mark.slow
def test_nonfinite_loss_halts_and_keeps_the_checkpoints(reference, tfds_data_dir, tmp_path):
  workdir = str(tmp_path / 'run')
  shutil.copytree(reference, workdir)
  before = {step: saved(workdir, step)[1] for step in (15, 18, 20)}
  # Resumes at step 20, then diverges in the third epoch, before its first checkpoint is due.
  config = _config(tfds_data_dir, num_epochs=3, learning_rate=1e30, checkpoint_every_steps=100)
  with pytest.raises(errors.NonFiniteError) as error:
    train.train_and_evaluate(run_spec.resolve(config), workdir)
  assert (error.value.step, error.value.last_checkpoint) == (25, 20)
  for step, state in before.items():
    for name, value in saved(workdir, step)[1].items():
      np.testing.assert_array_equal(value, state[name], err_msg=f'step {step}: {name}')
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['15', '18', '20']


@pytest.mark.slow
@pytest.mark.parametrize('overrides,names', [
    ({'model': 'mlp'}, ['not in the checkpoint: model.linears', 'only in the checkpoint: '
                        'model.batch_norm1']),
    ({'model_options': {'cnn': {'hidden_features': 128}}},
     ['shapes differ (checkpoint vs config): model.linear1.bias.value (256,) vs (128,)']),
    ({'optimizer': 'adam'}, ['not in the checkpoint: optimizer.opt_state.0.count.value']),
])
def test_resuming_with_a_different_structure_names_the_difference(
    reference, tfds_data_dir, tmp_path, overrides, names):
  # Without the saved config (which refuses such changes first, tests/test_reliability.py),
  # the checkpoint's own structure is checked.
  workdir = str(tmp_path / 'run')
  shutil.copytree(reference, workdir)
  os.remove(os.path.join(workdir, workdirs.CONFIG_FILE))
  with pytest.raises(errors.CheckpointError) as error:  # A third epoch, to resume.
    train.train_and_evaluate(run_spec.resolve(_config(tfds_data_dir, num_epochs=3, **overrides)), workdir)
  assert error.value.step == NUM_STEPS
  for name in names:
    assert name in str(error.value)


@pytest.mark.slow
def test_a_changed_number_of_steps_per_epoch_is_refused(reference, tfds_data_dir, tmp_path):
  workdir = str(tmp_path / 'run')
  shutil.copytree(reference, workdir)
  os.remove(os.path.join(workdir, workdirs.CONFIG_FILE))
  with pytest.raises(errors.ConfigError) as error:
    train.train_and_evaluate(run_spec.resolve(_config(tfds_data_dir, train_split='train[:2560]', num_epochs=3)),
                             workdir)
  assert error.value.key == 'train_split'


@pytest.mark.slow
def test_eval_only_reproduces_the_final_eval_of_training(reference, tfds_data_dir):
  """In-process: main.py's --mode=eval with only --workdir is tests/test_end_to_end.py's."""
  accuracy = _final_eval(reference)
  scores = evaluate.evaluate_checkpoint(run_spec.resolve(_config(tfds_data_dir)), reference)
  # The training run's last eval (a different count of 1,000 examples would differ by 1e-3).
  assert scores['eval/accuracy'] == pytest.approx(accuracy, abs=1e-6)
  # Written at the checkpoint's step, with its report.
  assert summaries.read_metrics(reference)[NUM_STEPS]['eval/accuracy'] == accuracy
  assert os.path.exists(evaluate.report_path(reference, OVERRIDES['eval_split'], NUM_STEPS,
                                             'json'))


def test_eval_only_without_checkpoint_says_so(tfds_data_dir, tmp_path):
  with pytest.raises(errors.CheckpointError) as error:
    evaluate.evaluate_checkpoint(run_spec.resolve(_config(tfds_data_dir)), str(tmp_path))
  assert error.value.directory == os.path.join(str(tmp_path), 'checkpoints')


def test_a_nonfinite_state_is_never_saved(tmp_path):
  state, _ = create(model='mlp')
  state.model.linears[-1].bias[...] = jnp.full(10, jnp.nan)
  checkpoints = checkpointing.Checkpoints(str(tmp_path))
  guard = hooks.NonFiniteGuard(checkpoints, every_steps=100)
  loop = hooks.Loop(state, steps_per_epoch=100, num_steps=1000, step=500)
  saves = hooks.Checkpointing(checkpoints, 500, guard)
  with pytest.raises(errors.NonFiniteError) as error:
    saves.after_step(loop, hooks.Hooks([], saves))
  assert (error.value.step, error.value.last_checkpoint) == (500, None)
  assert not checkpoints.all_steps()


def test_an_old_layout_is_refused_with_one_line(tmp_path):
  state, _ = create(model='mlp')
  manager = ocp.CheckpointManager(os.path.join(tmp_path, 'checkpoints'),
                                  item_handlers={'model': ocp.StandardCheckpointHandler()})
  manager.save(10, args=ocp.args.Composite(model=ocp.args.StandardSave(nnx.state(state.model))))
  manager.close()
  with pytest.raises(errors.CheckpointError) as error:
    checkpointing.Checkpoints(str(tmp_path)).restore_newest(state, move_aside=True)
  assert 'earlier version' in str(error.value)


def _files(directory):
  """{path: modification time} of every file under `directory`."""
  return {os.path.join(root, name): os.stat(os.path.join(root, name)).st_mtime_ns
          for root, _, names in os.walk(directory) for name in names}


def test_orbax_keeps_the_newest_and_the_best_by_the_metrics_saved_with_it(tmp_path):
  state, _ = create(model='mlp')
  checkpoints = checkpointing.Checkpoints(str(tmp_path), 'eval/loss', maximize=False,
                                          max_to_keep=2)
  progress = {'epoch': 1, 'step_in_epoch': 0, 'steps_per_epoch': 10, 'hooks': {}}
  for step, loss in ((5, None), (10, 0.3), (15, None), (20, 0.5), (30, 0.3), (40, 0.6),
                     (45, None)):
    checkpoints.save(step, state, {**progress, 'epoch': step // 10},
                     {} if loss is None else {'eval/loss': loss})
  checkpoints.close()
  # The newest 2, and the best: the lowest loss, the later of equals; the rest deleted.
  assert checkpoints.all_steps() == [30, 40, 45]
  assert checkpoints.best_step() == 30
  # Saved with the step: its metrics and score (the loss, negated: higher is better).
  with open(os.path.join(checkpoints.directory, '30', 'metrics', 'metrics')) as file:
    assert json.load(file) == {'eval/loss': 0.3, checkpointing.SCORE: -0.3}
  # Another run's init_from takes the best by the score alone, without this run's metric.
  assert checkpointing.checkpoint_path(str(tmp_path)) == os.path.join(
      checkpoints.directory, '30', 'state')
  reopened = checkpointing.Checkpoints(str(tmp_path), 'eval/loss', maximize=False)
  assert reopened.best_step() == 30
  assert reopened.latest_progress()['epoch'] == 4
  assert reopened.restore_newest(state, move_aside=True)[0] == 45
  assert reopened.restore(state, '40') == 40
  reopened.close()


def test_without_eval_metrics_there_is_no_best(tmp_path):
  state, _ = create(model='mlp')
  checkpoints = checkpointing.Checkpoints(str(tmp_path), 'eval/accuracy', max_to_keep=1)
  for step in (10, 20):
    checkpoints.save(step, state, {'epoch': 1}, {})
  assert checkpoints.all_steps() == [20] and checkpoints.best_step() is None
  with pytest.raises(errors.CheckpointError):
    checkpoints.restore(state, 'best')
  checkpoints.close()


def test_checkpoints_of_the_previous_version_are_read_with_their_metrics(tmp_path):
  """It kept the eval metrics in the step, as Orbax's metrics item."""
  state, _ = create(model='mlp')
  manager = ocp.CheckpointManager(
      os.path.join(tmp_path, checkpointing.CHECKPOINT_DIR),
      options=ocp.CheckpointManagerOptions(best_fn=lambda metrics: metrics['eval/accuracy']),
      item_handlers={'state': ocp.StandardCheckpointHandler(),
                     'progress': ocp.JsonCheckpointHandler()})
  for step, accuracy in ((10, 0.9), (20, 0.8)):
    manager.save(step, metrics={'eval/accuracy': accuracy}, args=ocp.args.Composite(
        state=ocp.args.StandardSave(nnx.state(state)),
        progress=ocp.args.JsonSave({'epoch': step // 10, 'layout': checkpointing.LAYOUT})))
  manager.close()
  checkpoints = checkpointing.Checkpoints(str(tmp_path), 'eval/accuracy')
  assert checkpoints.best_step() == 10
  assert checkpoints.restore_newest(state, move_aside=True) == (20, {'epoch': 2, 'layout': 2})
  checkpoints.close()


def test_a_reader_leaves_a_save_in_progress_alone(tmp_path):
  """Eval, predict, export and init_from may open a workdir while a run trains in it: what
  looks like a partial save to them may be that run's save in progress."""
  state, _ = create(model='mlp')
  checkpoints = checkpointing.Checkpoints(str(tmp_path), 'eval/accuracy')
  checkpoints.save(10, state, {'epoch': 1})
  checkpoints.close()
  in_progress = os.path.join(checkpoints.directory, '20.orbax-checkpoint-tmp-1234')
  os.makedirs(os.path.join(in_progress, 'state'))
  for reader, kept in ((True, True), (False, False)):  # Training's removes it.
    checkpoints = checkpointing.Checkpoints(str(tmp_path), 'eval/accuracy', reader=reader)
    assert checkpoints.restore(state, 'latest') == 10
    checkpoints.close()
    assert os.path.isdir(in_progress) == kept
  # Nor does a reader create a workdir's checkpoints directory.
  checkpointing.Checkpoints(str(tmp_path / 'none'), reader=True).close()
  assert not os.path.exists(tmp_path / 'none')
