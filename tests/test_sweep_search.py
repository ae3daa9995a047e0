"""sweep.py's random/TPE search: ranges and their errors, the study (pruning, resuming, adding
trials, refused reruns, one sweep per workdir) with a stand-in for main.py, and real tiny MNIST
searches."""

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import optuna
import pytest

from core import errors
from sweeps import engine
from sweeps import runs
from sweeps import spec
from tests.helpers.sweeps import accuracy
from tests.helpers.sweeps import FakeLauncher
from tests.helpers.sweeps import load_study
from tests.helpers.sweeps import METRIC
from tests.helpers.sweeps import NUM_EPOCHS
from tests.helpers.sweeps import run_study
from tests.helpers.sweeps import settings
from training import workdirs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Float = optuna.distributions.FloatDistribution
Categorical = optuna.distributions.CategoricalDistribution
MOMENTUM = 'optimizer_options.sgd.momentum'


def _space(*specs, overrides=None, config_file='configs/default.py'):
  return spec.search_space(config_file, overrides or {}, spec.parse_sweep_flags(list(specs)),
                           grid=False)


def test_ranges_parse_into_distributions():
  space = _space('learning_rate=loguniform(1e-3, 0.5)', f'{MOMENTUM}=uniform(0.5,0.9)',
                 'batch_size=int(16,64)', 'optimizer=choice(sgd,adam)', 'seed=1,2',
                 'model_options.cnn.dropout_rate=choice(0.0,0.1)')
  assert space == {
      'learning_rate': Float(0.001, 0.5, log=True), MOMENTUM: Float(0.5, 0.9),
      'batch_size': optuna.distributions.IntDistribution(16, 64),
      'optimizer': Categorical(['sgd', 'adam']),
      # A plain list searches as a choice; choices take their key's type.
      'seed': Categorical([1, 2]),
      'model_options.cnn.dropout_rate': Categorical([0.0, 0.1])}
  # An int range on a float key is fine: its values are floats to main.py.
  assert _space('learning_rate=int(1,2)')['learning_rate'].low == 1


def test_get_sweep_ranges_in_config_file():
  sweep_spec = spec.sweep_from_config_file('configs/lr_search.py')
  assert spec.search_space('configs/lr_search.py', {}, sweep_spec, grid=False) == {
      'learning_rate': Float(0.01, 0.5, log=True), MOMENTUM: Float(0.5, 0.95)}


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
  with pytest.raises(spec.SweepError, match=message) as error:
    spec.parse_sweep_flags([flag])
  assert (error.value.param, error.value.value) == tuple(flag.split('=', 1))


@pytest.mark.parametrize('flag,value,cause_key', [
    ('optimizer=uniform(0,1)', 'uniform(0.0,1.0)', None),  # A numeric range on a string key,
    ('data_source_options.torchvision.download=int(0,1)', 'int(0,1)', None),  # a bool key,
    ('batch_size=uniform(16,64)', 'uniform(16.0,64.0)', None),  # a float range on an int key.
    ('learning_rate=uniform(-1,1)', -1.0, 'learning_rate'),
    ('optimizer=choice(sgd,adamm)', 'adamm', 'optimizer'),
    ('batch_size=choice(64,big)', 'big', None),
    ('optimizer=choice()', '', None),
    ('seed=choice(1,1)', '1,1', None),
    ('learning_rat=uniform(0.1,1)', 'learning_rat', None),
])
def test_ranges_that_do_not_fit_the_config(flag, value, cause_key):
  with pytest.raises(spec.SweepError) as error:
    _space(flag)
  assert (error.value.param, error.value.value) == (flag.split('=')[0], value)
  if cause_key:
    assert isinstance(error.value.__cause__, errors.ConfigError)
    assert error.value.__cause__.key == cause_key


def test_swept_and_overridden_key_is_refused():
  with pytest.raises(spec.SweepError, match=f'config.{MOMENTUM} is both swept and set by'):
    _space(f'{MOMENTUM}=uniform(0.5,0.9)', overrides={MOMENTUM: '0.8'})
  with pytest.raises(spec.SweepError, match='Nothing to sweep'):
    _space()


SPACE = {'learning_rate': Float(0.001, 1.0, log=True)}
SETTINGS = settings({'learning_rate': 'loguniform(0.001,1.0)'}, 'random')


def _search(workdir, launcher, num_trials, prune=False, sweep_settings=SETTINGS):
  return run_study(workdir, launcher, SPACE, sweep_settings, num_trials, prune)


def test_pruning_follows_the_median_rule_and_pruned_trials_are_not_rerun(tmp_path):
  launcher = FakeLauncher()
  study = _search(tmp_path, launcher, num_trials=8, prune=True)
  trials = study.trials
  assert [trial.user_attrs['run'] for trial in trials] == [f'trial_{n:04d}' for n in range(8)]
  states = [trial.state for trial in trials]
  assert optuna.trial.TrialState.PRUNED in states and optuna.trial.TrialState.COMPLETE in states
  for trial, (_, args) in zip(trials, launcher.started):
    assert 0.001 <= trial.params['learning_rate'] <= 1.0
    # MedianPruner, after 2 complete trials: pruned at the first epoch (before the last) whose
    # accuracy is below the median of the earlier complete trials' accuracies there.
    earlier = [other for other in trials[:trial.number]
               if other.state == optuna.trial.TrialState.COMPLETE]
    pruned_at = next((epoch for epoch in range(1, NUM_EPOCHS) if len(earlier) >= 2 and
                      accuracy(args, epoch) < np.median(
                          [other.intermediate_values[epoch] for other in earlier])), None)
    if pruned_at:
      assert trial.state == optuna.trial.TrialState.PRUNED
      assert launcher.epochs_run[trial.user_attrs['run']] == pruned_at  # Stopped there.
      assert trial.user_attrs['epochs'] == pruned_at
    else:
      assert trial.state == optuna.trial.TrialState.COMPLETE
      assert trial.value == accuracy(args, NUM_EPOCHS) == trial.user_attrs[f'best_{METRIC}']
    assert trial.intermediate_values == {
        epoch: accuracy(args, epoch) for epoch in range(1, (pruned_at or NUM_EPOCHS) + 1)}

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
  rows, _ = engine.results(study, SPACE)
  assert [(row['run'], row['state']) for row in rows] == [('trial_0000', 'complete'),
                                                          ('trial_0001', 'interrupted')]

  resumed = FakeLauncher()
  study = _search(tmp_path, resumed, num_trials=3)
  assert resumed.started[0] == stopped.started[1]  # Same run dir, same parameters.
  assert resumed.epochs_run['trial_0001'] == NUM_EPOCHS - 1  # It continued after epoch 1.
  # Trial 1 was superseded by trial 2, its resumption; trial 3 is the search's third.
  assert [name for name, _ in resumed.started] == ['trial_0001', 'trial_0003']
  assert [trial.number for trial in engine.trials(study)] == [0, 2, 3]
  trial = study.trials[2]
  assert trial.state == optuna.trial.TrialState.COMPLETE and trial.user_attrs['resumes'] == 1
  assert trial.params == study.trials[1].params
  assert trial.intermediate_values == {epoch: accuracy(stopped.started[1][1], epoch)
                                       for epoch in range(1, NUM_EPOCHS + 1)}
  rows, _ = engine.results(study, SPACE)
  assert sorted(row['run'] for row in rows) == ['trial_0000', 'trial_0001', 'trial_0003']
  assert {row['state'] for row in rows} == {'complete'}


def test_rerun_with_other_settings_is_refused(tmp_path):
  _search(tmp_path, FakeLauncher(), num_trials=1)
  other = {**SETTINGS, 'space': {'learning_rate': 'loguniform(0.001,0.5)'}}
  with pytest.raises(spec.SweepError, match=r"The study in .* was run with other settings \("
                                            r"space \{'learning_rate': 'loguniform\(0.001,1.0\)'"
                                            r"\} there, \{'learning_rate': 'loguniform\(0.001,"
                                            r"0.5\)'\} now\): rerun it with its own \(only "
                                            '--num_trials, --parallel, --prune'):
    _search(tmp_path, FakeLauncher(), num_trials=2, sweep_settings=other)
  with pytest.raises(spec.SweepError, match="search 'random' there, 'tpe' now"):
    _search(tmp_path, FakeLauncher(), num_trials=2, sweep_settings={**SETTINGS, 'search': 'tpe'})


def test_results_table_has_a_row_per_trial(tmp_path):
  study = _search(tmp_path, FakeLauncher(), num_trials=3)
  rows, columns = engine.results(study, SPACE)
  assert columns == ['trial', 'state', 'learning_rate', f'best_{METRIC}', f'final_{METRIC}',
                     'epochs', 'wall_time_s', runs.TEST_METRIC, 'run']
  table = runs.write_results(rows, columns, METRIC, True, str(tmp_path)).splitlines()
  assert table[0] == '| ' + ' | '.join(columns) + ' |' and len(table) == 5
  with open(tmp_path / 'sweep_results.csv') as f:
    written = list(csv.DictReader(f))
  best = [float(row[f'best_{METRIC}']) for row in written]
  assert best == sorted(best, reverse=True)
  assert {row['run'] for row in written} == {'trial_0000', 'trial_0001', 'trial_0002'}
  assert all(row['state'] == 'complete' and row['epochs'] == str(NUM_EPOCHS) for row in written)


def test_one_sweep_at_a_time_per_workdir(tmp_path):
  with workdirs.hold(str(tmp_path)):
    with pytest.raises(errors.WorkdirBusy) as error:
      with workdirs.hold(str(tmp_path)):
        pass
  assert error.value.workdir == str(tmp_path) and str(os.getpid()) in error.value.holder
  with workdirs.hold(str(tmp_path)):  # Released at the end of the block.
    pass


# Real searches: tiny MLP runs on real MNIST (2 epochs of 4-8 steps, 256 eval examples).
SEARCH_FLAGS = ('--search=random', '--search_seed=10', '--sweep=learning_rate=loguniform(1e-4,0.3)',
                f'--sweep={MOMENTUM}=uniform(0.5,0.9)', '--sweep=batch_size=choice(32,64)',
                '--config.model=mlp', '--config.num_epochs=2', '--config.train_split=train[:256]',
                '--config.eval_split=test[:256]', '--config.evaluators=loss|accuracy')


def _command(workdir, data_dir, *args):
  return [sys.executable, 'sweep.py', '--config=configs/default.py', f'--workdir={workdir}',
          f'--config.data_dir={data_dir}', *SEARCH_FLAGS, *args]


def _run(workdir, data_dir, *args):
  return subprocess.run(_command(workdir, data_dir, *args), cwd=ROOT, capture_output=True,
                        text=True, timeout=600)


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
  best = [float(row[f'best_{METRIC}']) for row in rows]
  assert best == sorted(best, reverse=True) and best[0] > 0.2  # Sorted; better than chance.
  for row in rows:
    assert row['state'] == 'complete' and row['epochs'] == '2'
    assert 1e-4 <= float(row['learning_rate']) <= 0.3 and 0.5 <= float(row[MOMENTUM]) <= 0.9
    assert row['batch_size'] in ('32', '64')
    # main.py ran with the sampled values: the config it saved holds them.
    with open(random_search / row['run'] / 'config.json') as f:
      config = json.load(f)
    assert config['learning_rate'] == float(row['learning_rate'])
    assert config['optimizer_options']['sgd']['momentum'] == float(row[MOMENTUM])
    assert config['batch_size'] == int(row['batch_size'])
  markdown = (random_search / 'sweep_results.md').read_text().splitlines()
  assert markdown[0] == (f'| trial | state | learning_rate | {MOMENTUM} | batch_size | '
                         f'best_{METRIC} | final_{METRIC} | epochs | wall_time_s | run |')


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
  interrupted = load_study(workdir).trials[4]
  assert interrupted.state == optuna.trial.TrialState.RUNNING
  assert not (workdir / 'trial_0005').exists()

  # Rerun two at a time (--parallel may change between runs of a study): the resumption and
  # the new trial start together, each judged against trials 0-3, the only complete ones.
  result = _run(workdir, tfds_data_dir, *more, '--parallel=2')
  assert result.returncode == 0, result.stderr[-3000:]
  assert '4 finished, 1 to resume, 1 to run' in result.stderr
  study = load_study(workdir)
  trials = engine.trials(study)
  # Trial 4 is finished as superseded by trial 5, which resumed it in trial_0004.
  assert study.trials[4].state == optuna.trial.TrialState.FAIL
  assert [trial.number for trial in trials] == [0, 1, 2, 3, 5, 6]
  assert trials[4].params == interrupted.params and trials[4].user_attrs['run'] == 'trial_0004'
  assert 'epoch 1/2' in (workdir / 'trial_0004' / 'main.log').read_text()  # Same dir.
  assert {path: mtime for path, mtime in _files(workdir).items()
          if path.relative_to(workdir).parts[0] < 'trial_0004'} == files  # 0-3 did not rerun.
  for trial in trials[4:]:
    complete = [other.intermediate_values[1] for other in trials[:trials.index(trial)]
                if other.state == optuna.trial.TrialState.COMPLETE]
    should_prune = trial.intermediate_values[1] < np.median(complete)
    assert trial.state == (optuna.trial.TrialState.PRUNED if should_prune else
                           optuna.trial.TrialState.COMPLETE)
  # Trial 4's learning rate (seed 10) is 100x below the others': its first epoch is the worst.
  assert trials[4].state == optuna.trial.TrialState.PRUNED
  with open(workdir / 'sweep_results.csv') as f:
    states = {row['run']: row['state'] for row in csv.DictReader(f)}
  assert states['trial_0004'] == 'pruned' and len(states) == 6
