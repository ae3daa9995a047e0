"""training/loggers.py: each logger's files or tracker run, read back with the tool's own reader,
across a resumed run (a second writer on the same workdir)."""

import csv
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import jax
import numpy as np
import pytest

from tests.helpers.optional import requires_extras
from core import errors
from training import loggers
from training import summaries

HPARAMS = {'learning_rate': 0.1, 'model': 'cnn', 'model_options': {'cnn': {'features': (32, 64)}},
           'init_from': None, 'note': 'x' * 7000}


def _accuracy(step: int) -> float:
  return 0.5 + step / 1000


def _write_run(writer, steps):
  """Writes eval/accuracy and epoch at `steps`, and closes `writer`."""
  for step in steps:
    writer.write_scalars(step, {'eval/accuracy': _accuracy(step), 'epoch': step // 10})
  writer.close()


def _read_csv(workdir) -> list[tuple[int, str, float]]:
  with open(os.path.join(workdir, loggers.CSV_FILE), encoding='utf-8', newline='') as file:
    rows = list(csv.reader(file))
  assert rows[0] == ['step', 'name', 'value']
  return [(int(step), name, float(value)) for step, name, value in rows[1:]]


def test_csv_new_names_mid_run_and_resumed_appends(tmp_path):
  writer = loggers.create_writer('csv', str(tmp_path))
  writer.write_scalars(10, {'train/loss': np.float32(0.5), 'epoch': 1})
  writer.write_scalars(20, {'eval/accuracy': 0.9})  # A name first written mid-run.
  writer.close()
  with open(tmp_path / loggers.CSV_FILE, 'a', encoding='utf-8') as file:
    file.write('30,train/lo')  # The last row of a run killed while writing it.
  resumed = loggers.create_writer('csv', str(tmp_path))
  resumed.write_scalars(20, {'eval/accuracy': 0.95, 'test/accuracy': 0.93})
  resumed.close()
  assert _read_csv(tmp_path) == [(10, 'train/loss', 0.5), (10, 'epoch', 1.0),
                                 (20, 'eval/accuracy', 0.9), (20, 'eval/accuracy', 0.95),
                                 (20, 'test/accuracy', 0.93)]


def test_default_loggers_write_events_and_jsonl(tmp_path):
  writer = loggers.create_writer('tensorboard|jsonl', str(tmp_path))
  _write_run(writer, [10, 20])
  assert summaries.read_metrics(str(tmp_path)) == {
      10: {'eval/accuracy': _accuracy(10), 'epoch': 1},
      20: {'eval/accuracy': _accuracy(20), 'epoch': 2}}
  assert any(name.startswith('events.out.tfevents') for name in os.listdir(tmp_path))


def test_other_processes_write_nothing(tmp_path, monkeypatch):
  monkeypatch.setattr(jax, 'process_index', lambda: 1)
  writer = loggers.create_writer('tensorboard|jsonl|csv', str(tmp_path))
  _write_run(writer, [10])
  assert not os.listdir(tmp_path)


def test_unknown_logger_is_a_config_error_before_any_file(tmp_path):
  with pytest.raises(errors.ConfigError) as error:
    loggers.create_writer('tensorboard|jsonl|neptune', str(tmp_path))
  assert (error.value.key, error.value.value) == ('loggers', 'neptune')
  assert not os.listdir(tmp_path)


def test_bad_logger_option_is_a_config_error(tmp_path):
  with pytest.raises(errors.ConfigError) as error:
    loggers.create_writer('csv(delimiter=";")', str(tmp_path))
  assert error.value.key == 'loggers'


@pytest.mark.parametrize('package', ['mlflow', 'wandb'])
def test_missing_package_before_any_file(tmp_path, monkeypatch, package):
  monkeypatch.setitem(sys.modules, package, None)  # `import package` raises ImportError.
  with pytest.raises(errors.MissingPackage) as error:
    loggers.create_writer(f'tensorboard|jsonl|{package}', str(tmp_path))
  assert (error.value.key, error.value.value, error.value.package) == ('loggers', package, package)
  assert not os.listdir(tmp_path)


def _check_mlflow_run(workdir, steps, experiment='Default'):
  """The workdir's one MLflow run, read back with MLflow's client: every step, the params."""
  import mlflow  # pylint: disable=g-import-not-at-top
  runs = mlflow.search_runs(experiment_names=[experiment], output_format='list')
  assert [run.info.run_id for run in runs] == [(workdir / loggers.MLFLOW_RUN_ID_FILE).read_text()
                                               .strip()]
  run = runs[0]
  history = mlflow.MlflowClient().get_metric_history(run.info.run_id, 'eval/accuracy')
  assert sorted((metric.step, metric.value) for metric in history) == [
      (step, _accuracy(step)) for step in steps]
  assert run.info.status == 'FINISHED'
  params = run.data.params
  assert (params['learning_rate'], params['model'], params['model_options.cnn.features']) == (
      '0.1', 'cnn', '(32, 64)')
  assert 'init_from' not in params
  assert params['note'] == 'x' * mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
  return run


def _log_mlflow_run_and_resume(workdir, spec='tensorboard|mlflow'):
  writer = loggers.create_writer(spec, str(workdir))
  writer.write_hparams(HPARAMS)
  writer.write_images(10, {'eval/confusion_matrix': np.zeros((1, 4, 4, 3), np.uint8)})
  writer.write_texts(0, {'config': 'model: cnn'})
  _write_run(writer, [10, 20])
  resumed = loggers.create_writer(spec, str(workdir))
  resumed.write_hparams({**HPARAMS, 'learning_rate': 0.2})  # Changed: the first value stays.
  _write_run(resumed, [30, 40])


def test_mlflow_resumed_run_continues_the_same_run(tmp_path, monkeypatch):
  requires_extras('mlflow')
  import mlflow  # pylint: disable=g-import-not-at-top
  # MLflow's local database store: 3.17 refuses its file store (file:) unless
  # MLFLOW_ALLOW_FILE_STORE=true. Its artifacts go to ./mlruns.
  monkeypatch.setenv('MLFLOW_TRACKING_URI', f'sqlite:///{tmp_path / "mlflow.db"}')
  monkeypatch.chdir(tmp_path)
  monkeypatch.delenv('MLFLOW_EXPERIMENT_NAME', raising=False)
  workdir = tmp_path / 'run'
  workdir.mkdir()
  _log_mlflow_run_and_resume(workdir)
  run = _check_mlflow_run(workdir, [10, 20, 30, 40])
  artifacts = mlflow.MlflowClient().list_artifacts(run.info.run_id)
  assert {'images', 'texts'} <= {artifact.path for artifact in artifacts}


def test_mlflow_store_that_refuses_is_one_config_error(tmp_path, monkeypatch):
  """MLflow 3 refuses a file: store (without MLFLOW_ALLOW_FILE_STORE=true): one line naming
  config.loggers, before any metric."""
  requires_extras('mlflow')
  monkeypatch.setenv('MLFLOW_TRACKING_URI', f'file:{tmp_path / "store"}')
  monkeypatch.delenv('MLFLOW_ALLOW_FILE_STORE', raising=False)
  with pytest.raises(errors.ConfigError) as error:
    loggers.create_writer('mlflow', str(tmp_path))
  assert (error.value.key, error.value.value) == ('loggers', 'mlflow')
  assert not os.path.exists(tmp_path / loggers.MLFLOW_RUN_ID_FILE)


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(('127.0.0.1', 0))
    return sock.getsockname()[1]


@pytest.mark.slow
def test_mlflow_server_over_http(tmp_path, monkeypatch):
  requires_extras('mlflow')
  port = _free_port()
  log = tmp_path / 'server.log'
  with open(log, 'wb') as output:
    server = subprocess.Popen(  # pylint: disable=consider-using-with
        [os.path.join(os.path.dirname(sys.executable), 'mlflow'), 'server', '--host', '127.0.0.1',
         '--port', str(port), '--workers', '1',
         '--backend-store-uri', f'sqlite:///{tmp_path / "mlflow.db"}',
         '--artifacts-destination', str(tmp_path / 'artifacts')],
        stdout=output, stderr=subprocess.STDOUT,
        # Without its job executor (for MLflow's GenAI jobs), which the loggers do not use.
        env={**os.environ, 'MLFLOW_SERVER_ENABLE_JOB_EXECUTION': 'false'})
  try:
    url = f'http://127.0.0.1:{port}'
    # It took 15-85 s to answer on 2 busy cores (importing its app and creating the database).
    deadline = time.monotonic() + 120
    while True:
      try:
        with urllib.request.urlopen(f'{url}/health', timeout=2) as response:
          if response.status == 200:
            break
      except OSError:
        assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.5)
    monkeypatch.setenv('MLFLOW_TRACKING_URI', url)
    monkeypatch.delenv('MLFLOW_EXPERIMENT_NAME', raising=False)
    workdir = tmp_path / 'run'
    workdir.mkdir()
    _log_mlflow_run_and_resume(workdir, 'tensorboard|mlflow(experiment="mnist")')
    _check_mlflow_run(workdir, [10, 20, 30, 40], experiment='mnist')
  finally:
    server.terminate()
    server.wait(timeout=30)


def _read_wandb_log(wandb_file) -> tuple[str, dict, dict[int, float]]:
  """The run id, config and {step: eval/accuracy} of a .wandb log, read by wandb's own
  `wandb leet inspect`."""
  output = subprocess.run([sys.executable, '-m', 'wandb', 'leet', 'inspect', '--json',
                           str(wandb_file)], capture_output=True, text=True, check=True).stdout
  records = [json.loads(line) for line in output.splitlines()]
  [run_id] = [record['run']['run_id'] for record in records if record['type'] == 'run']
  config = {}
  for record in records:
    if record['type'] == 'config':
      config.update(record['config']['update'])
  return run_id, config, {
      record['history']['step']['num']: record['history']['item']['eval/accuracy']
      for record in records if record['type'] == 'history'}


def test_wandb_offline_resumed_run_keeps_its_id(tmp_path, monkeypatch):
  requires_extras('wandb')
  for variable in ('WANDB_DIR', 'WANDB_CACHE_DIR', 'WANDB_CONFIG_DIR', 'WANDB_DATA_DIR'):
    monkeypatch.setenv(variable, str(tmp_path / variable.lower()))
  monkeypatch.setenv('WANDB_MODE', 'offline')
  workdir = tmp_path / 'run'
  workdir.mkdir()
  writer = loggers.create_writer('wandb', str(workdir))
  writer.write_hparams(HPARAMS)
  writer.write_images(10, {'eval/confusion_matrix': np.zeros((1, 4, 4, 3), np.uint8)})
  _write_run(writer, [10, 20])
  run_id = (workdir / loggers.WANDB_RUN_ID_FILE).read_text().strip()
  time.sleep(1)  # Offline run directories are named by the second they start in.
  resumed = loggers.create_writer('wandb', str(workdir))
  _write_run(resumed, [30, 40])
  assert (workdir / loggers.WANDB_RUN_ID_FILE).read_text().strip() == run_id
  # Offline, each process writes its own log of the run's id; `wandb sync` joins them.
  first, second = [_read_wandb_log(log)
                   for log in sorted(workdir.glob('wandb/offline-run-*/run-*.wandb'))]
  assert (first[0], second[0]) == (run_id, run_id)
  assert (first[2], second[2]) == ({step: _accuracy(step) for step in (10, 20)},
                                   {step: _accuracy(step) for step in (30, 40)})
  config = first[1]
  assert (config['learning_rate'], config['model_options.cnn.features']) == (0.1, [32, 64])
  assert 'init_from' not in config


@pytest.mark.slow
def test_a_training_run_logs_every_epoch_and_its_config_to_mlflow_and_resumes_there(
    tfds_data_dir, tmp_path, monkeypatch):
  """config.loggers='tensorboard|mlflow' (jsonl added): MLflow's own client reads back
  eval/accuracy of every epoch, in one run across a resume, and the config as params."""
  requires_extras('mlflow')
  import mlflow  # pylint: disable=g-import-not-at-top
  from configs import default  # pylint: disable=g-import-not-at-top
  import train  # pylint: disable=g-import-not-at-top
  from training import run_spec  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv('MLFLOW_TRACKING_URI', f'sqlite:///{tmp_path / "mlflow.db"}')
  monkeypatch.chdir(tmp_path)
  monkeypatch.delenv('MLFLOW_EXPERIMENT_NAME', raising=False)
  config = default.get_config()
  config.update({'data_dir': tfds_data_dir, 'train_split': 'train[:256]',
                 'eval_split': 'test[:128]', 'batch_size': 64, 'num_epochs': 2,
                 'evaluators': 'loss|accuracy', 'loggers': 'tensorboard|mlflow'})
  workdir = str(tmp_path / 'run')
  train.train_and_evaluate(run_spec.resolve(config), workdir)
  config.num_epochs = 3  # Resumed: the same MLflow run goes on.
  train.train_and_evaluate(run_spec.resolve(config), workdir)
  jsonl = summaries.read_metrics(workdir)
  runs = mlflow.search_runs(experiment_names=['Default'], output_format='list')
  assert len(runs) == 1
  history = mlflow.MlflowClient().get_metric_history(runs[0].info.run_id, 'eval/accuracy')
  assert sorted((metric.step, metric.value) for metric in history) == [
      (step, pytest.approx(jsonl[step]['eval/accuracy'])) for step in (4, 8, 12)]
  assert (runs[0].data.params['learning_rate'], runs[0].data.params['model']) == ('0.1', 'cnn')
