"""sweep.py's grid: spec checks, the study's grid with a stand-in for main.py (resuming, parallel
runs, refused workdirs), a real 2x2 MNIST sweep, its rerun, and TensorBoard serving it."""

import csv
import itertools
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import optuna
import pytest

from core import errors
from sweeps import engine
from sweeps import spec
from tests.helpers.sweeps import accuracy
from tests.helpers.sweeps import BASE_ARGS
from tests.helpers.sweeps import FakeLauncher
from tests.helpers.sweeps import GRID
from tests.helpers.sweeps import GRID_SETTINGS
from tests.helpers.sweeps import load_study
from tests.helpers.sweeps import NUM_EPOCHS
from tests.helpers.sweeps import run_study

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Categorical = optuna.distributions.CategoricalDistribution


def _space(*specs, overrides=None, config_file='configs/default.py', grid=True):
  return spec.search_space(config_file, overrides or {}, spec.parse_sweep_flags(list(specs)),
                           grid)


def test_grid_space_takes_typed_values_and_checks_every_point():
  assert _space('learning_rate=0.05,0.1', 'batch_size=64,128', overrides={'seed': '3'}) == GRID
  assert _space('model_options.cnn.dropout_rate=0.0,0.1') == {
      'model_options.cnn.dropout_rate': Categorical([0.0, 0.1])}
  # Tuples (from a get_sweep() list), which Optuna cannot store, are kept as their flag text.
  assert spec.search_space('configs/default.py', {}, {
      'model_options.mlp.hidden_features': ['(64,)', '(32, 32)']}, grid=True) == {
          'model_options.mlp.hidden_features': Categorical(['(64,)', '(32, 32)'])}
  # Each value passes alone; 2 warm-up epochs in a 1-epoch run do not.
  with pytest.raises(spec.SweepError) as error:
    _space('num_epochs=1,3', 'warmup_epochs=0,2')
  assert error.value.value == 'num_epochs=1,warmup_epochs=2.0' and error.value.param is None
  assert isinstance(error.value.__cause__, errors.ConfigError)
  assert error.value.__cause__.key == 'warmup_epochs'


def test_get_sweep_in_config_file():
  sweep_spec = spec.sweep_from_config_file('configs/lr_sweep.py')
  space = spec.search_space('configs/lr_sweep.py', {}, sweep_spec, grid=True)
  assert space == {'learning_rate': Categorical([0.01, 0.05, 0.1]),
                   'batch_size': Categorical([64, 128])}
  with pytest.raises(spec.SweepError) as error:  # A range is for a random/TPE search.
    spec.search_space('configs/lr_search.py', {},
                      spec.sweep_from_config_file('configs/lr_search.py'), grid=True)
  assert (error.value.param, error.value.value) == ('learning_rate', 'loguniform(0.01,0.5)')
  assert 'a grid runs lists of values' in str(error.value)


@pytest.mark.parametrize('specs,overrides,param,value,cause_key', [
    (['learning_rat=0.1'], {}, 'learning_rat', 'learning_rat', None),
    (['learning_rate=0.1,fast'], {}, 'learning_rate', 'fast', None),
    (['batch_size=64,1.5'], {}, 'batch_size', '1.5', None),
    (['learning_rate='], {}, 'learning_rate', '', None),
    (['learning_rate=0.1,'], {}, 'learning_rate', '0.1,', None),
    (['learning_rate=0.1,0.1'], {}, 'learning_rate', '0.1,0.1', None),
    (['learning_rate=0.1,-1'], {}, 'learning_rate', '-1', 'learning_rate'),
    (['optimizer=sgd,adamm'], {}, 'optimizer', 'adamm', 'optimizer'),
    (['learning_rate'], {}, None, 'learning_rate', None),
    (['seed=1', 'seed=2'], {}, 'seed', 'seed=2', None),
    (['seed=1,2'], {'seed': '3'}, 'seed', '3', None),
    ([], {}, None, None, None),
])
def test_bad_sweep_specs(specs, overrides, param, value, cause_key):
  with pytest.raises(spec.SweepError) as error:
    _space(*specs, overrides=overrides)
  assert isinstance(error.value, errors.ConfigError) and error.value.key == 'sweep'
  assert (error.value.param, error.value.value) == (param, value)
  if cause_key:  # A value main.py would refuse: the config check's own error is the cause.
    assert error.value.__cause__.key == cause_key
  assert error.value.one_line().startswith('Sweep error: ')


@pytest.mark.parametrize('parallel', [1, 3])
def test_grid_runs_every_point_once_with_the_overrides(tmp_path, parallel):
  # With 3 at a time, the last point starts while 2 run: none may be handed out twice.
  launcher = FakeLauncher(seconds_per_epoch=0.02)
  study = run_study(tmp_path, launcher, parallel=parallel)
  assert sorted(args for _, args in launcher.started) == sorted(
      (*BASE_ARGS, f'--config.learning_rate={lr}', f'--config.batch_size={bs}')
      for lr, bs in itertools.product([0.05, 0.1], [64, 128]))
  assert sorted(name for name, _ in launcher.started) == [f'trial_{n:04d}' for n in range(4)]
  assert all(trial.state == optuna.trial.TrialState.COMPLETE for trial in study.trials)
  rerun = FakeLauncher()
  run_study(tmp_path, rerun)
  assert not rerun.started


@pytest.mark.parametrize('parallel', [1, 2])
def test_interrupted_grid_point_resumes_in_its_dir_and_runs_once(tmp_path, parallel):
  stopped = FakeLauncher(stop_sweep_in='trial_0001', seconds_per_epoch=0.05)
  study = run_study(tmp_path, stopped, parallel=parallel)
  interrupted = study.trials[1]
  assert interrupted.state == optuna.trial.TrialState.RUNNING
  assert ('trial_0001', interrupted.user_attrs['run']) == (stopped.started[1][0], 'trial_0001')

  resumed = FakeLauncher(seconds_per_epoch=0.05)
  study = run_study(tmp_path, resumed, parallel=parallel)
  assert ('trial_0001', stopped.started[1][1]) in resumed.started  # Same dir, same values.
  assert resumed.epochs_run['trial_0001'] == NUM_EPOCHS - 1  # It continued after epoch 1.
  # Every point ran to its end once: those of the first sweep and the rest now.
  points = [args for name, args in stopped.started + resumed.started if name != 'trial_0001']
  assert len(points) == len(set(points)) == 3
  assert stopped.started[1][1] not in points
  # The interrupted trial is finished, superseded by its resumption, and counts nowhere.
  trials = engine.trials(study)
  assert len(trials) == 4 and 1 not in [trial.number for trial in trials]
  assert all(trial.state == optuna.trial.TrialState.COMPLETE for trial in trials)
  assert study.trials[1].state == optuna.trial.TrialState.FAIL
  resumption = next(trial for trial in trials if trial.user_attrs['run'] == 'trial_0001')
  assert resumption.user_attrs['resumes'] == 1
  assert resumption.params == interrupted.params
  assert resumption.intermediate_values == {
      epoch: accuracy(stopped.started[1][1], epoch) for epoch in range(1, NUM_EPOCHS + 1)}
  rows, _ = engine.results(study, GRID)
  assert sorted(row['run'] for row in rows) == sorted(trial.user_attrs['run'] for trial in trials)
  assert {row['state'] for row in rows} == {'complete'}
  rerun = FakeLauncher()
  run_study(tmp_path, rerun, parallel=parallel)
  assert not rerun.started


def test_resumption_left_waiting_by_a_killed_sweep_runs_once(tmp_path):
  old = run_study(tmp_path, FakeLauncher(stop_sweep_in='trial_0001')).trials[1]
  study = load_study(tmp_path)
  # As a sweep killed after it enqueued the resumption, before it finished the old trial.
  study.enqueue_trial(old.params, user_attrs={**old.user_attrs, 'resumes': old.number})
  launcher = FakeLauncher()
  rows, _ = engine.results(run_study(tmp_path, launcher), GRID)
  assert sorted(name for name, _ in launcher.started) == ['trial_0001', 'trial_0003',
                                                          'trial_0004']
  assert len({args for _, args in launcher.started}) == 3
  assert sorted(row['run'] for row in rows) == ['trial_0000', 'trial_0001', 'trial_0003',
                                                'trial_0004']
  assert {row['state'] for row in rows} == {'complete'}


def test_workdirs_of_the_old_grid_and_other_settings_are_refused(tmp_path):
  run_study(tmp_path / 'grid', FakeLauncher())
  with pytest.raises(spec.SweepError, match='was run with other settings') as error:
    run_study(tmp_path / 'grid', FakeLauncher(),
              sweep_settings={**GRID_SETTINGS, 'overrides': '--config.seed=1'})
  assert error.value.value == str(tmp_path / 'grid')
  (tmp_path / 'old' / 'learning_rate=0.1').mkdir(parents=True)
  (tmp_path / 'old' / 'learning_rate=0.1' / engine.OLD_GRID_FILE).write_text('{}')
  with pytest.raises(spec.SweepError, match='holds a grid of an older sweep.py') as error:
    run_study(tmp_path / 'old', FakeLauncher())
  assert error.value.value == str(tmp_path / 'old')
  assert not (tmp_path / 'old' / engine.STUDY_FILE).exists()


def _sweep(workdir, *args, data_dir):
  """Runs a 2x2 sweep of tiny real-MNIST MLP runs (10-20 steps, 500 eval and 500 test
  examples)."""
  return subprocess.run(
      [sys.executable, 'sweep.py', '--config=configs/default.py', f'--workdir={workdir}',
       '--sweep=learning_rate=0.05,0.1', '--sweep=batch_size=64,128',
       f'--config.data_dir={data_dir}', '--config.model=mlp', '--config.num_epochs=1',
       '--config.train_split=train[:1280]', '--config.eval_split=test[:500]',
       '--config.test_split=test[500:1000]', *args],
      cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_bad_spec_fails_before_any_run(tmp_path):
  workdir = tmp_path / 'sweep'
  for args, message in [
      (['--sweep=learning_rate=0.1', '--sweep=batch_size=64,big'],
       "Sweep error: Sweep of 'batch_size', value big: "),
      (['--sweep=learning_rate=0.1,0.2', '--num_trials=2'],
       'Sweep error: --num_trials is for --search=random or tpe'),
      (['--search=random', '--sweep=learning_rate=uniform(0.01,0.1)'],
       'Sweep error: --search=random needs --num_trials=N')]:
    result = subprocess.run([sys.executable, 'sweep.py', '--config=configs/default.py',
                             f'--workdir={workdir}', *args],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1].startswith(message), result.stderr[-3000:]
    assert not workdir.exists()


@pytest.fixture(scope='module')
def finished_sweep(tfds_data_dir, tmp_path_factory):
  """The workdir of a finished 2x2 sweep, run two at a time."""
  workdir = tmp_path_factory.mktemp('sweep')
  result = _sweep(workdir, '--parallel=2', data_dir=tfds_data_dir)
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir


@pytest.mark.slow
def test_sweep_runs_tables_and_skips_when_rerun(finished_sweep, tfds_data_dir):
  runs_ = {f'trial_{n:04d}' for n in range(4)}
  assert {path.name for path in finished_sweep.iterdir() if path.is_dir()} == runs_
  with open(finished_sweep / 'sweep_results.csv') as f:
    rows = list(csv.DictReader(f))
  assert {row['run'] for row in rows} == runs_
  assert {(row['learning_rate'], row['batch_size']) for row in rows} == set(
      itertools.product(['0.05', '0.1'], ['64', '128']))
  best = [float(row['best_eval/accuracy']) for row in rows]
  assert best == sorted(best, reverse=True) and best[0] > 0.5  # Sorted; better than chance.
  assert all(row['state'] == 'complete' and row['epochs'] == '1' and
             row['best_eval/accuracy'] == row['final_eval/accuracy'] for row in rows)
  for row in rows:  # main.py ran with the overrides and the grid point's values.
    with open(finished_sweep / row['run'] / 'config.json') as f:
      config = json.load(f)
    assert config['model'] == 'mlp' and config['num_epochs'] == 1
    assert (str(config['learning_rate']), str(config['batch_size'])) == (
        row['learning_rate'], row['batch_size'])
  markdown = (finished_sweep / 'sweep_results.md').read_text().splitlines()
  assert markdown[0] == ('| trial | state | learning_rate | batch_size | best_eval/accuracy | '
                         'final_eval/accuracy | epochs | wall_time_s | test/accuracy | run |')
  assert len(markdown) == 6
  # The test split, scored once per run with its best checkpoint, gets a column.
  assert all(0.5 < float(row['test/accuracy']) <= 1 for row in rows)

  files = {path: path.stat().st_mtime_ns for path in finished_sweep.glob('trial_*/*')}
  result = _sweep(finished_sweep, data_dir=tfds_data_dir)
  assert result.returncode == 0, result.stderr[-3000:]
  assert '4 finished, 0 to resume, 0 to run' in result.stderr
  assert {path: path.stat().st_mtime_ns for path in finished_sweep.glob('trial_*/*')} == files
  with open(finished_sweep / 'sweep_results.csv') as f:
    assert list(csv.DictReader(f)) == rows


@pytest.mark.slow
def test_rerun_with_other_settings_is_refused(finished_sweep, tfds_data_dir):
  result = _sweep(finished_sweep, '--config.seed=1', data_dir=tfds_data_dir)
  assert result.returncode == 1
  line = result.stderr.splitlines()[-1]
  assert line.startswith('Sweep error: The study in ') and 'other settings (overrides' in line
  assert line.endswith('or use another --workdir.')


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _get(url, body=None):
  request = urllib.request.Request(url, data=body and json.dumps(body).encode(),
                                   headers={'Content-Type': 'application/json'})
  with urllib.request.urlopen(request, timeout=30) as response:
    return json.load(response)


@pytest.mark.slow
def test_tensorboard_serves_scalars_hparams_and_images(finished_sweep):
  with open(finished_sweep / 'sweep_results.csv') as f:
    rows = {row['run']: row for row in csv.DictReader(f)}
  port = _free_port()
  url = f'http://127.0.0.1:{port}/data'
  server = subprocess.Popen(
      [sys.executable, '-m', 'tensorboard.main', f'--logdir={finished_sweep}',
       '--host=127.0.0.1', f'--port={port}'],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    # Ready once it serves, and has loaded all four runs (it loads in the background).
    deadline = time.time() + 180
    while True:
      assert server.poll() is None, 'tensorboard exited'
      assert time.time() < deadline, 'tensorboard did not load the runs in time'
      try:
        scalars = _get(f'{url}/plugin/scalars/tags')
        if set(scalars) == set(rows):
          break
      except OSError:
        pass
      time.sleep(1)

    for tags in scalars.values():
      assert {'train/loss', 'train/accuracy', 'eval/loss', 'eval/accuracy',
              'learning_rate'} <= set(tags)
    images = _get(f'{url}/plugin/images/tags')
    assert all({'eval/confusion_matrix', 'eval/misclassified'} <= set(images[run])
               for run in rows)
    experiment = _get(f'{url}/plugin/hparams/experiment', {'experimentName': ''})
    metrics = ['eval/loss', 'eval/accuracy', 'test/loss', 'test/accuracy']
    assert sorted(metric['name']['tag'] for metric in experiment['metricInfos']) == sorted(metrics)
    assert {'learning_rate', 'batch_size'} <= {info['name'] for info in experiment['hparamInfos']}
    groups = _get(f'{url}/plugin/hparams/session_groups',
                  {'experimentName': '', 'startIndex': 0, 'sliceSize': 100,
                   'allowedStatuses': ['STATUS_UNKNOWN', 'STATUS_SUCCESS']})['sessionGroups']
    sessions = {group['sessions'][0]['name']: group for group in groups}
    assert set(sessions) == set(rows)
    for run, group in sessions.items():
      assert (group['hparams']['learning_rate'], group['hparams']['batch_size']) == (
          float(rows[run]['learning_rate']), int(rows[run]['batch_size']))
      assert {value['name']['tag'] for value in group['metricValues']} == set(metrics)
  finally:
    server.terminate()
    server.wait(timeout=30)
