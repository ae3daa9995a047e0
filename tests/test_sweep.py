"""sweep.py: spec checks, a real 2x2 MNIST sweep, its rerun, and TensorBoard serving it."""

import csv
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import sweep
from sweeps import spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {'learning_rate=0.05,batch_size=64', 'learning_rate=0.05,batch_size=128',
        'learning_rate=0.1,batch_size=64', 'learning_rate=0.1,batch_size=128'}


def _plan(*specs, overrides=None, config_file='configs/default.py'):
  return sweep.plan_runs(config_file, overrides or {}, spec.parse_sweep_flags(list(specs)))


def test_plan_is_the_product_with_overrides():
  runs = _plan('learning_rate=0.05,0.1', 'batch_size=64,128', overrides={'num_epochs': '2'})
  assert {run.name for run in runs} == RUNS
  assert runs[1].args == ('--config.num_epochs=2', '--config.learning_rate=0.05',
                          '--config.batch_size=128')


def test_nested_keys_sweep():
  runs = _plan('model_options.cnn.dropout_rate=0.0,0.1')
  assert [run.args for run in runs] == [('--config.model_options.cnn.dropout_rate=0.0',),
                                        ('--config.model_options.cnn.dropout_rate=0.1',)]
  with pytest.raises(spec.SweepError, match=r"Sweep key 'model_options.cnn.dropout' is not in "
                                             r'the config'):
    _plan('model_options.cnn.dropout=0.0,0.1')


def test_get_sweep_in_config_file():
  runs = sweep.plan_runs('configs/lr_sweep.py', {},
                         spec.sweep_from_config_file('configs/lr_sweep.py'))
  assert len(runs) == 6 and runs[0].name == 'learning_rate=0.01,batch_size=64'


@pytest.mark.parametrize('specs,overrides,message', [
    (['learning_rat=0.1'], {}, r"Sweep key 'learning_rat' is not in the config; valid keys: .*"
                               'learning_rate'),
    (['learning_rate=0.1,fast'], {}, r"Run 'learning_rate=fast'.*learning_rate=fast: could not "
                                     'convert string to float'),
    (['batch_size=64,1.5'], {}, r"Run 'batch_size=1.5'.*invalid literal for int"),
    (['learning_rate='], {}, r"Sweep of 'learning_rate' has an empty value list"),
    (['learning_rate=0.1,'], {}, r"Sweep of 'learning_rate' has .*an empty value"),
    (['learning_rate=0.1,0.1'], {}, r"Sweep of 'learning_rate' repeats a value"),
    (['learning_rate=0.1,-1'], {}, r"Run 'learning_rate=-1'.*config.learning_rate=-1.0 is "
                                   'invalid: it must be > 0'),
    (['learning_rate'], {}, r"--sweep='learning_rate' is not of the form 'key=value1,value2"),
    (['seed=1', 'seed=2'], {}, r"--sweep gives 'seed' twice"),
    (['seed=1,2'], {'seed': '3'}, r'config.seed is both swept and set by --config.seed'),
    ([], {}, r'Nothing to sweep'),
])
def test_bad_sweep_specs(specs, overrides, message):
  with pytest.raises(spec.SweepError, match=message):
    _plan(*specs, overrides=overrides)


def _sweep(workdir, *args, data_dir):
  """Runs a 2x2 sweep of tiny real-MNIST MLP runs (10-20 steps, 1,000 eval and 500 test
  examples)."""
  return subprocess.run(
      [sys.executable, 'sweep.py', '--config=configs/default.py', f'--workdir={workdir}',
       '--sweep=learning_rate=0.05,0.1', '--sweep=batch_size=64,128',
       f'--config.data_dir={data_dir}', '--config.model=mlp', '--config.num_epochs=1',
       "--config.train_split=train[:1280]", '--config.eval_split=test[:1000]',
       '--config.test_split=test[1000:1500]', *args],
      cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_bad_spec_fails_before_any_run(tmp_path):
  workdir = tmp_path / 'sweep'
  result = subprocess.run(
      [sys.executable, 'sweep.py', '--config=configs/default.py', f'--workdir={workdir}',
       '--sweep=learning_rate=0.1', '--sweep=batch_size=64,big'],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  assert "Sweep error: Run 'learning_rate=0.1,batch_size=big'" in result.stderr
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
  run_dirs = {path.name for path in finished_sweep.iterdir() if path.is_dir()}
  assert run_dirs == RUNS
  with open(finished_sweep / 'sweep_results.csv') as f:
    rows = list(csv.DictReader(f))
  assert {row['run'] for row in rows} == RUNS
  best = [float(row['best_eval_accuracy']) for row in rows]
  assert best == sorted(best, reverse=True) and best[0] > 0.5  # Sorted; better than chance.
  assert all(row['epochs'] == '1' and row['best_eval_accuracy'] == row['final_eval_accuracy']
             for row in rows)
  for row in rows:
    swept = ' '.join(f'--config.{override}' for override in row['run'].split(','))
    assert row['overrides'].endswith(swept) and '--config.model=mlp' in row['overrides']
  markdown = (finished_sweep / 'sweep_results.md').read_text().splitlines()
  assert markdown[0].startswith('| run | overrides | best_eval_accuracy') and len(markdown) == 6
  # The test split, scored once per run with its best checkpoint, gets a column.
  assert markdown[0].rstrip().endswith('| test_accuracy |')
  assert all(0.5 < float(row['test_accuracy']) <= 1 for row in rows)

  files = {path: path.stat().st_mtime_ns for path in finished_sweep.glob('*/*')}
  result = _sweep(finished_sweep, data_dir=tfds_data_dir)
  assert result.returncode == 0, result.stderr[-3000:]
  assert '4 finished, 0 to run' in result.stderr
  assert {path: path.stat().st_mtime_ns for path in finished_sweep.glob('*/*')} == files
  with open(finished_sweep / 'sweep_results.csv') as f:
    assert list(csv.DictReader(f)) == rows


@pytest.mark.slow
def test_rerun_with_other_settings_is_refused(finished_sweep, tfds_data_dir):
  result = _sweep(finished_sweep, '--config.seed=1', data_dir=tfds_data_dir)
  assert result.returncode == 1
  assert 'finished with --config=configs/default.py' in result.stderr
  assert 'use another --workdir' in result.stderr


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
        if set(scalars) == RUNS:
          break
      except OSError:
        pass
      time.sleep(1)

    for tags in scalars.values():
      assert {'train_loss', 'train_accuracy', 'eval_loss', 'eval_accuracy',
              'learning_rate'} <= set(tags)
    images = _get(f'{url}/plugin/images/tags')
    assert all(set(images[run]) == {'eval_confusion_matrix', 'eval_misclassified'}
               for run in RUNS)
    experiment = _get(f'{url}/plugin/hparams/experiment', {'experimentName': ''})
    assert [metric['name']['tag'] for metric in experiment['metricInfos']] == [
        'eval_accuracy', 'eval_loss', 'test_accuracy', 'test_loss']
    assert {'learning_rate', 'batch_size'} <= {info['name'] for info in experiment['hparamInfos']}
    groups = _get(f'{url}/plugin/hparams/session_groups',
                  {'experimentName': '', 'startIndex': 0, 'sliceSize': 100,
                   'allowedStatuses': ['STATUS_UNKNOWN', 'STATUS_SUCCESS']})['sessionGroups']
    sessions = {group['sessions'][0]['name']: group for group in groups}
    assert set(sessions) == RUNS
    for run, group in sessions.items():
      assert run == f'learning_rate={group["hparams"]["learning_rate"]},' \
                    f'batch_size={group["hparams"]["batch_size"]:.0f}'
      assert {value['name']['tag'] for value in group['metricValues']} == {
          'eval_accuracy', 'eval_loss', 'test_accuracy', 'test_loss'}
  finally:
    server.terminate()
    server.wait(timeout=30)
