"""sweep.py's random/TPE search: ranges and their errors, the Optuna study (pruning, resuming,
adding trials, refused reruns) with a stand-in for main.py, and real tiny MNIST searches."""

import csv
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import optuna
import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import plugin_data_pb2
import tensorflow as tf

import sweep
from sweeps import runs
from sweeps import search
from sweeps import spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Float = optuna.distributions.FloatDistribution


def _space(*specs, overrides=None, config_file='configs/default.py'):
  return spec.search_space(config_file, overrides or {}, spec.parse_sweep_flags(list(specs)))


def test_ranges_parse_into_distributions():
  space = _space('learning_rate=loguniform(1e-3, 0.5)', 'momentum=uniform(0.5,0.9)',
                 'batch_size=int(16,64)', 'optimizer=choice(sgd,adam)', 'seed=1,2',
                 'model_options.cnn.dropout_rate=choice(0.0,0.1)')
  assert space == {
      'learning_rate': Float(0.001, 0.5, log=True), 'momentum': Float(0.5, 0.9),
      'batch_size': optuna.distributions.IntDistribution(16, 64),
      'optimizer': optuna.distributions.CategoricalDistribution(['sgd', 'adam']),
      # A plain list searches as a choice; choices take their key's type.
      'seed': optuna.distributions.CategoricalDistribution([1, 2]),
      'model_options.cnn.dropout_rate': optuna.distributions.CategoricalDistribution([0.0, 0.1])}
  # An int range on a float key is fine: its values are floats to main.py.
  assert _space('learning_rate=int(1,2)')['learning_rate'].low == 1


def test_get_sweep_ranges_in_config_file():
  sweep_spec = spec.sweep_from_config_file('configs/lr_search.py')
  assert spec.search_space('configs/lr_search.py', {}, sweep_spec) == {
      'learning_rate': Float(0.01, 0.5, log=True), 'momentum': Float(0.5, 0.95)}
  with pytest.raises(spec.SweepError, match=r"Sweep of 'learning_rate' is a range, "
                                            r'loguniform\(0.01,0.5\): a grid runs lists'):
    sweep.plan_runs('configs/lr_search.py', {}, sweep_spec)


@pytest.mark.parametrize('flag,message', [
    ('learning_rate=uniform(0.1,1', r"Sweep of 'learning_rate': 'uniform\(0.1,1' is not a "
                                    r'complete range; write one of uniform\(a,b\)'),
    ('learning_rate=normal(0,1)', r"unknown distribution 'normal' in 'normal\(0,1\)'; use "
                                  r'uniform\(a,b\), loguniform\(a,b\), int\(a,b\) or choice'),
    ('learning_rate=uniform(0.5,0.1)', r"'uniform\(0.5,0.1\)' needs finite bounds a < b"),
    ('learning_rate=uniform(0.1,0.1)', r"'uniform\(0.1,0.1\)' needs finite bounds a < b"),
    ('learning_rate=uniform(0.1,inf)', r'needs finite bounds'),
    ('learning_rate=uniform(0.1)', r"'uniform\(0.1\)' needs two bounds that are numbers"),
    ('learning_rate=uniform(low,1)', r"'uniform\(low,1\)' needs two bounds that are numbers"),
    ('batch_size=int(16,64.5)', r"'int\(16,64.5\)' needs two bounds that are integers"),
    ('learning_rate=loguniform(0,1)', r"'loguniform\(0,1\)' needs 0 < a"),
])
def test_malformed_ranges(flag, message):
  with pytest.raises(spec.SweepError, match=message):
    spec.parse_sweep_flags([flag])


@pytest.mark.parametrize('flag,message', [
    ('optimizer=uniform(0,1)', r"Sweep of 'optimizer': uniform\(0.0,1.0\) is a numeric range, "
                               r"but config.optimizer is 'sgd'; give its values as choice"),
    ('halt_on_nonfinite=int(0,1)', r'is a numeric range, but config.halt_on_nonfinite is True'),
    ('batch_size=uniform(16,64)', r"config.batch_size is an integer \(128\): use int\(a,b\)"),
    ('learning_rate=uniform(-1,1)', r"Sweep of 'learning_rate', value -1.0: "
                                    r'config.learning_rate=-1.0 is invalid: it must be > 0'),
    ('optimizer=choice(sgd,adamm)', r"Sweep of 'optimizer', value adamm: Unknown optimizer"),
    ('batch_size=choice(64,big)', r"Sweep of 'batch_size', value big: .*invalid literal for int"),
    ('optimizer=choice()', r"Sweep of 'optimizer' has an empty value list or an empty value"),
    ('seed=choice(1,1)', r"Sweep of 'seed' repeats a value"),
    ('learning_rat=uniform(0.1,1)', r"Sweep key 'learning_rat' is not in the config"),
])
def test_ranges_that_do_not_fit_the_config(flag, message):
  with pytest.raises(spec.SweepError, match=message):
    _space(flag)


def test_swept_and_overridden_key_is_refused():
  with pytest.raises(spec.SweepError, match='config.momentum is both swept and set by'):
    _space('momentum=uniform(0.5,0.9)', overrides={'momentum': '0.8'})
  with pytest.raises(spec.SweepError, match='Nothing to search'):
    _space()


NUM_EPOCHS = 3
BASE_ARGS = (f'--config.num_epochs={NUM_EPOCHS}',)
SPACE = {'learning_rate': Float(0.001, 1.0, log=True)}


def _accuracy(learning_rate: float, epoch: int) -> float:
  """The stand-in's eval accuracy: larger learning rates and later epochs do better."""
  return float(np.float32(1 - 1 / (1 + 10 * learning_rate * epoch)))  # As TensorBoard stores it.


class FakeLauncher:
  """Stands in for runs.Launcher: a run writes the eval_accuracy of each epoch as main.py does
  (continuing after the epochs its dir holds), polling `should_stop` after each."""

  def __init__(self, stop_sweep_in=None):
    self.stopped_by = None
    self.started = []  # (run name, args) of every run started.
    self.epochs_run = {}  # Run name -> epochs written by its last run.
    self._stop_sweep_in = stop_sweep_in  # The run in which the sweep gets a SIGTERM.

  def run(self, name, run_dir, args, should_stop=None):
    self.started.append((name, args))
    os.makedirs(run_dir, exist_ok=True)
    learning_rate = float(args[-1].partition('--config.learning_rate=')[2])
    done = len(runs.scalars(run_dir, ['eval_accuracy'])['eval_accuracy'])
    writer = tf.summary.create_file_writer(run_dir)
    for epoch in range(done + 1, NUM_EPOCHS + 1):
      with writer.as_default():
        tf.summary.scalar('eval_accuracy', _accuracy(learning_rate, epoch), step=epoch * 10)
      writer.flush()
      self.epochs_run[name] = epoch - done
      if name == self._stop_sweep_in:
        self._stop_sweep_in, self.stopped_by = None, signal.SIGTERM
        return 128 + signal.SIGTERM
      if should_stop and should_stop():
        return 128 + signal.SIGTERM
    return 0


SETTINGS = {'config': 'configs/default.py', 'overrides': ' '.join(BASE_ARGS), 'search': 'random',
            'metric': 'eval_accuracy', 'space': {'learning_rate': 'loguniform(0.001,1.0)'}}


def _search(workdir, launcher, num_trials, prune=False, settings=None):
  os.makedirs(workdir, exist_ok=True)
  study = search.open_study(str(workdir), settings or SETTINGS, 'random', search_seed=0,
                            startup_trials=2, prune=prune)
  search.run_trials(study, SPACE, num_trials, 1, launcher, 'configs/default.py', BASE_ARGS,
                    str(workdir), 'eval_accuracy')
  return study


def test_pruning_follows_the_median_rule_and_pruned_trials_are_not_rerun(tmp_path):
  launcher = FakeLauncher()
  study = _search(tmp_path, launcher, num_trials=8, prune=True)
  trials = study.trials
  assert [trial.user_attrs['run'] for trial in trials] == [f'trial_{n:04d}' for n in range(8)]
  states = [trial.state for trial in trials]
  assert optuna.trial.TrialState.PRUNED in states and optuna.trial.TrialState.COMPLETE in states
  for trial in trials:
    lr = trial.params['learning_rate']
    assert 0.001 <= lr <= 1.0
    # MedianPruner, after 2 complete trials: pruned at the first epoch (before the last) whose
    # accuracy is below the median of the earlier complete trials' accuracies there.
    earlier = [other for other in trials[:trial.number]
               if other.state == optuna.trial.TrialState.COMPLETE]
    pruned_at = next((epoch for epoch in range(1, NUM_EPOCHS) if len(earlier) >= 2 and
                      _accuracy(lr, epoch) < np.median(
                          [other.intermediate_values[epoch] for other in earlier])), None)
    if pruned_at:
      assert trial.state == optuna.trial.TrialState.PRUNED
      assert launcher.epochs_run[trial.user_attrs['run']] == pruned_at  # Stopped there.
      assert trial.user_attrs['epochs'] == pruned_at
    else:
      assert trial.state == optuna.trial.TrialState.COMPLETE
      assert trial.value == _accuracy(lr, NUM_EPOCHS) == trial.user_attrs['best_eval_accuracy']
    assert trial.intermediate_values == {
        epoch: _accuracy(lr, epoch) for epoch in range(1, (pruned_at or NUM_EPOCHS) + 1)}

  rerun = FakeLauncher()
  _search(tmp_path, rerun, num_trials=8, prune=True)
  assert not rerun.started  # Complete and pruned trials alike are finished.


def test_more_trials_continue_the_study_without_repeating_it(tmp_path):
  first = _search(tmp_path, FakeLauncher(), num_trials=3).trials
  launcher = FakeLauncher()
  trials = _search(tmp_path, launcher, num_trials=5).trials
  assert [name for name, _ in launcher.started] == ['trial_0003', 'trial_0004']
  assert [trial.params for trial in trials[:3]] == [trial.params for trial in first]
  learning_rates = [trial.params['learning_rate'] for trial in trials]
  assert len(set(learning_rates)) == 5  # The reopened sampler did not draw the first ones again.

  # The same sequence of commands gives the same trials.
  _search(tmp_path / 'again', FakeLauncher(), num_trials=3)
  again = _search(tmp_path / 'again', FakeLauncher(), num_trials=5).trials
  assert [trial.params for trial in again] == [trial.params for trial in trials]


def test_interrupted_trial_resumes_in_its_own_dir(tmp_path):
  stopped = FakeLauncher(stop_sweep_in='trial_0001')
  study = _search(tmp_path, stopped, num_trials=3)
  assert [name for name, _ in stopped.started] == ['trial_0000', 'trial_0001']  # Then stopped.
  assert [trial.state for trial in study.trials] == [optuna.trial.TrialState.COMPLETE,
                                                     optuna.trial.TrialState.RUNNING]
  assert search.results(study, SPACE, 'eval_accuracy')[0][1]['state'] == 'interrupted'

  resumed = FakeLauncher()
  study = _search(tmp_path, resumed, num_trials=3)
  assert resumed.started[0] == stopped.started[1]  # Same run dir, same parameters.
  assert resumed.epochs_run['trial_0001'] == NUM_EPOCHS - 1  # It continued after epoch 1.
  assert [name for name, _ in resumed.started] == ['trial_0001', 'trial_0002']
  trial = study.trials[1]
  assert trial.state == optuna.trial.TrialState.COMPLETE
  assert trial.intermediate_values == {epoch: _accuracy(trial.params['learning_rate'], epoch)
                                       for epoch in range(1, NUM_EPOCHS + 1)}


def test_rerun_with_other_settings_is_refused(tmp_path):
  _search(tmp_path, FakeLauncher(), num_trials=1)
  other = {**SETTINGS, 'space': {'learning_rate': 'loguniform(0.001,0.5)'}}
  with pytest.raises(spec.SweepError, match=r"The study in .* was run with other settings \("
                                            r"space \{'learning_rate': 'loguniform\(0.001,1.0\)'"
                                            r"\} there, \{'learning_rate': 'loguniform\(0.001,"
                                            r"0.5\)'\} now\): rerun it with its own \(only "
                                            '--num_trials, --parallel, --prune'):
    _search(tmp_path, FakeLauncher(), num_trials=2, settings=other)
  with pytest.raises(spec.SweepError, match="search 'random' there, 'tpe' now"):
    _search(tmp_path, FakeLauncher(), num_trials=2, settings={**SETTINGS, 'search': 'tpe'})


def test_results_table_has_a_row_per_trial(tmp_path):
  study = _search(tmp_path, FakeLauncher(), num_trials=3)
  rows, columns = search.results(study, SPACE, 'eval_accuracy')
  assert columns == ['trial', 'state', 'learning_rate', 'best_eval_accuracy',
                     'final_eval_accuracy', 'epochs', 'wall_time_s', 'run']
  table = runs.write_results(rows, columns, 'eval_accuracy', str(tmp_path)).splitlines()
  assert table[0] == '| ' + ' | '.join(columns) + ' |' and len(table) == 5
  with open(tmp_path / 'sweep_results.csv') as f:
    written = list(csv.DictReader(f))
  best = [float(row['best_eval_accuracy']) for row in written]
  assert best == sorted(best, reverse=True)
  assert {row['run'] for row in written} == {'trial_0000', 'trial_0001', 'trial_0002'}
  assert all(row['state'] == 'complete' and row['epochs'] == str(NUM_EPOCHS) for row in written)



def test_one_sweep_at_a_time_per_workdir(tmp_path):
  with runs.hold(str(tmp_path)):
    with pytest.raises(spec.SweepError, match='is in use by another sweep.py: wait for it'):
      with runs.hold(str(tmp_path)):
        pass
  with runs.hold(str(tmp_path)):  # Released at the end of the block.
    pass


def test_grid_in_a_search_workdir_is_refused(tmp_path):
  (tmp_path / search.STUDY_FILE).touch()
  with pytest.raises(spec.SweepError, match=r'holds a random/TPE search \(optuna_journal.log\)'):
    sweep.check_finished_runs([], 'configs/default.py', str(tmp_path))

# Real searches: tiny MLP runs on real MNIST (2 epochs of 4-8 steps, 256 eval examples).
SEARCH_FLAGS = ('--search=random', '--search_seed=10', '--sweep=learning_rate=loguniform(1e-4,0.3)',
                '--sweep=momentum=uniform(0.5,0.9)', '--sweep=batch_size=choice(32,64)',
                '--config.model=mlp', '--config.num_epochs=2', '--config.train_split=train[:256]',
                '--config.eval_split=test[:256]', '--config.num_misclassified_images=0')


def _command(workdir, data_dir, *args):
  return [sys.executable, 'sweep.py', '--config=configs/default.py', f'--workdir={workdir}',
          f'--config.data_dir={data_dir}', *SEARCH_FLAGS, *args]


def _run(workdir, data_dir, *args):
  return subprocess.run(_command(workdir, data_dir, *args), cwd=ROOT, capture_output=True,
                        text=True, timeout=600)


def _study(workdir):
  return optuna.load_study(study_name=search.STUDY_NAME, storage=optuna.storages.JournalStorage(
      optuna.storages.journal.JournalFileBackend(str(workdir / search.STUDY_FILE))))


def _files(workdir):
  return {path: path.stat().st_mtime_ns for path in workdir.glob('trial_*/**/*')}


@pytest.fixture(scope='module')
def random_search(tfds_data_dir, tmp_path_factory):
  """The workdir of a finished 4-trial random search, run two at a time."""
  workdir = tmp_path_factory.mktemp('search')
  result = _run(workdir, tfds_data_dir, '--num_trials=4', '--parallel=2')
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir


@pytest.mark.slow
def test_random_search_writes_a_row_per_trial(random_search):
  with open(random_search / 'sweep_results.csv') as f:
    rows = list(csv.DictReader(f))
  assert sorted(int(row['trial']) for row in rows) == [0, 1, 2, 3]
  best = [float(row['best_eval_accuracy']) for row in rows]
  assert best == sorted(best, reverse=True) and best[0] > 0.2  # Sorted; better than chance.
  for row in rows:
    assert row['state'] == 'complete' and row['epochs'] == '2'
    assert 1e-4 <= float(row['learning_rate']) <= 0.3 and 0.5 <= float(row['momentum']) <= 0.9
    assert row['batch_size'] in ('32', '64')
    # main.py ran with the sampled values: its HParams (one session per trial) show them.
    accumulator = event_accumulator.EventAccumulator(str(random_search / row['run']))
    accumulator.Reload()
    hparams = plugin_data_pb2.HParamsPluginData.FromString(accumulator.SummaryMetadata(
        '_hparams_/session_start_info').plugin_data.content).session_start_info.hparams
    assert hparams['learning_rate'].number_value == float(row['learning_rate'])
    assert hparams['momentum'].number_value == float(row['momentum'])
    assert hparams['batch_size'].number_value == int(row['batch_size'])
  markdown = (random_search / 'sweep_results.md').read_text().splitlines()
  assert markdown[0] == ('| trial | state | learning_rate | momentum | batch_size | '
                         'best_eval_accuracy | final_eval_accuracy | epochs | wall_time_s | run |')


@pytest.mark.slow
def test_search_rerun_starts_no_run(random_search, tfds_data_dir):
  files = _files(random_search)
  result = _run(random_search, tfds_data_dir, '--num_trials=4', '--parallel=2')
  assert result.returncode == 0, result.stderr[-3000:]
  assert '4 finished, 0 to resume, 0 to run' in result.stderr
  assert 'Run trial_' not in result.stderr and _files(random_search) == files


@pytest.mark.slow
def test_killed_search_resumes_and_more_trials_are_pruned(random_search, tfds_data_dir,
                                                          tmp_path):
  workdir = tmp_path / 'search'
  shutil.copytree(random_search, workdir)
  files = _files(workdir)
  more = ('--num_trials=6', '--prune', '--startup_trials=2')
  process = subprocess.Popen(_command(workdir, tfds_data_dir, *more), cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 120
  while not (workdir / 'trial_0004' / 'main.log').exists():
    assert process.poll() is None and time.time() < deadline, process.communicate()[1][-3000:]
    time.sleep(0.2)
  process.send_signal(signal.SIGTERM)  # To sweep.py only, while trial 4's main.py starts.
  _, stderr = process.communicate(timeout=120)
  assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
  assert 'Stopped by SIGTERM: rerun the same command to resume' in stderr
  interrupted = _study(workdir).trials[4]
  assert interrupted.state == optuna.trial.TrialState.RUNNING
  assert not (workdir / 'trial_0005').exists()

  result = _run(workdir, tfds_data_dir, *more)
  assert result.returncode == 0, result.stderr[-3000:]
  assert '4 finished, 1 to resume, 1 to run' in result.stderr
  trials = _study(workdir).trials
  assert len(trials) == 6 and trials[4].params == interrupted.params
  assert 'epoch 1/2' in (workdir / 'trial_0004' / 'main.log').read_text()  # Same dir.
  assert {path: mtime for path, mtime in _files(workdir).items()
          if path.relative_to(workdir).parts[0] < 'trial_0004'} == files  # 0-3 did not rerun.
  for trial in trials[4:]:
    complete = [other.intermediate_values[1] for other in trials[:trial.number]
                if other.state == optuna.trial.TrialState.COMPLETE]
    should_prune = trial.intermediate_values[1] < np.median(complete)
    assert trial.state == (optuna.trial.TrialState.PRUNED if should_prune else
                           optuna.trial.TrialState.COMPLETE)
  # Trial 4's learning rate (seed 10) is 100x below the others': its first epoch is the worst.
  assert trials[4].state == optuna.trial.TrialState.PRUNED
  with open(workdir / 'sweep_results.csv') as f:
    states = {row['trial']: row['state'] for row in csv.DictReader(f)}
  assert states['4'] == 'pruned' and len(states) == 6
