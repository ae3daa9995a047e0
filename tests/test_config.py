"""Bad input fails fast, before any data is read, as a typed error naming the key and value."""

import glob
import json
import importlib
import os
import subprocess
import sys

import pytest

import image_folders

from configs import default
from core import errors
from core import saved_config
from data_sources import base
import train
from training import workdirs
from training import run_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize('key,value,error_key', [
    ('model', 'resnet5000', 'model'),
    ('optimizer', 'sgdd', 'optimizer'),
    ('schedule', 'linearish', 'schedule'),
    ('loss', 'hinge', 'loss'),
    ('data_source', 'csvv', 'data_source'),
    ('batch_size', 0, 'batch_size'),
    ('batch_size', -5, 'batch_size'),
    ('num_epochs', 0, 'num_epochs'),
    ('learning_rate', 0.0, 'learning_rate'),
    ('learning_rate', -0.1, 'learning_rate'),
    ('eval_batch_size', 0, 'eval_batch_size'),
    ('checkpoint_every_steps', 0, 'checkpoint_every_steps'),
    ('max_checkpoints_to_keep', 0, 'max_checkpoints_to_keep'),
    ('kernels', 'on', 'kernels'),
    ('ema_decay', 1.0, 'ema_decay'),
    ('warmup_epochs', 11.0, 'warmup_epochs'),
    ('early_stopping_patience', -1, 'early_stopping_patience'),
    ('early_stopping_min_delta', -0.1, 'early_stopping_min_delta'),
    ('evaluators', 'accuracy|recall_at(3)', 'evaluators'),
    ('evaluators', 'accuracy|accuracy', 'evaluators'),
    ('test_evaluators', 'accuracy|top_k(0)', 'test_evaluators'),
    ('best_metric', 'eval_accuracy', 'best_metric'),  # The name before the split prefixes.
    ('best_metric', 'test/accuracy', 'best_metric'),  # The test split never picks.
    ('best_metric', 'eval/macro_f1', 'best_metric'),  # Not computed by the evaluators.
    ('model_options', {'cnn': {'dropout': 0.1}}, 'model_options.cnn.dropout'),
])
def test_bad_values_fail_before_data_is_read(tmp_path, key, value, error_key):
  config = default.get_config()
  config[key] = value
  # A data dir that does not exist: reading data would fail differently.
  config.data_dir = str(tmp_path / 'no_data_here')
  with pytest.raises(errors.ConfigError) as error:
    train.train_and_evaluate(run_spec.resolve(config), str(tmp_path / 'workdir'))
  assert error.value.key == error_key
  assert not (tmp_path / 'no_data_here').exists()


def test_an_unknown_tfds_dataset_is_a_config_error(tmp_path):
  config = default.get_config()
  config.dataset = 'mnistt'
  with pytest.raises(errors.ConfigError) as error:
    train.train_and_evaluate(run_spec.resolve(config), str(tmp_path))
  assert (error.value.key, error.value.value) == ('dataset', 'mnistt')


@pytest.mark.parametrize('path', sorted(glob.glob(os.path.join(ROOT, 'configs', '*.py'))))
def test_every_shipped_config_passes_the_checks(path):
  config = importlib.import_module(f'configs.{os.path.basename(path)[:-3]}').get_config()
  run_spec.resolve(config)


def test_batch_larger_than_train_split():
  config = default.get_config()
  config.batch_size = 70_000
  info = base.DatasetInfo('mnist', (28, 28, 1), 10, 60_000, 10_000)
  with pytest.raises(errors.ConfigError) as error:
    run_spec.resolve(config).check_against_data(info, 1)
  assert (error.value.key, error.value.value) == ('batch_size', 70_000)


def test_unwritable_workdir(tmp_path):
  blocker = tmp_path / 'a_file'
  blocker.write_text('not a directory')
  with pytest.raises(errors.StorageError) as error:
    workdirs.check_writable(str(blocker / 'runs'))
  assert error.value.path == str(blocker / 'runs')
  with pytest.raises(errors.FlagError) as error:  # A workdir that is a file.
    workdirs.check_writable(str(blocker))
  assert (error.value.flag, error.value.value) == ('workdir', str(blocker))


def _main(*args):
  return subprocess.run([sys.executable, 'main.py', *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)


@pytest.mark.parametrize('args,line', [
    (['--config.num_epochs=0'], 'Config error: config.num_epochs=0 '),
    (['--config.learning_rate=-1'], 'Config error: config.learning_rate=-1.0 '),
    (["--config.freeze=['(']"], 'Config error: config.freeze '),
    (['--config.eval_tta=mirror'], "Config error: config.eval_tta='mirror' "),
    (['--mode=predict', '--inputs=photos', '--tta=mirror'], 'Flag error: flag --tta=mirror: '),
    (['--mode=predict', '--inputs=photos', '--top_k=0'], 'Flag error: flag --top_k=0: '),
])
def test_a_number_or_choice_mistake_is_refused_before_jax_starts(tmp_path, args, line):
  """Refused by main.py before it imports TensorFlow and JAX: the line that JAX's start logs
  never comes."""
  result = _main('--config=configs/default.py', *args, f'--workdir={tmp_path}')
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1].startswith(line), result.stderr
  assert 'JAX process 0 of 1' not in result.stderr
  assert os.listdir(tmp_path) == []  # Nothing written.


@pytest.mark.slow
@pytest.mark.parametrize('args,line', [
    (['--config=configs/nope.py'], "Config error: cannot read the config file 'configs/nope.py'"),
    (['--config=configs/default.py', '--config.learnin_rate=0.1'],
     'Config error: --config.learnin_rate is not a key of the config (Did you mean '
     '"learning_rate" instead of "learnin_rate"?)'),
    (['--config=configs/default.py', '--config.model_options.cnn.dropout=0.1'],
     'Config error: --config.model_options.cnn.dropout is not a key of the config'),
    (['--config=configs/default.py', '--config.batch_size=abc'],
     'Flag error: flag --config.batch_size=abc:'),
    (['--config=configs/default.py', '--config.num_epochs=0'],
     'Config error: config.num_epochs=0 is invalid: it must be an integer >= 1.'),
    (['--config=configs/default.py', '--mode=predict'],
     'Flag error: --mode=predict needs --inputs=PATH'),
    (['--config=configs/default.py', '--config.data_source=folder',
      '--config.dataset=/no/such/folder'],
     "Config error: Image folder '/no/such/folder' does not exist"),
    (['--config=configs'], "Config error: cannot read the config file 'configs' (a directory)"),
    (['--config=configs/default.py', '--config.evaluations.holdout.every=2'],
     'Config error: --config.evaluations.holdout.every is not a key of the config'),
    (['--mode=eval', '--config.evaluations.holdout.every=2'],  # The default config, at import.
     'Config error: --config.evaluations.holdout.every is not a key of the config'),
    (['--config=configs/default.py', '--config.cpu_kernels=off'],  # A renamed key.
     "Config error: --config.cpu_kernels is not a key of the config (it is now config.kernels "
     "('off' is now 'stock'))"),
])
def test_cli_mistakes_end_in_one_line(tmp_path, args, line):
  result = _main(*args, f'--workdir={tmp_path}')
  assert result.returncode == 1
  assert 'Traceback' not in result.stderr
  assert result.stderr.strip().splitlines()[-1].startswith(line), result.stderr[-2000:]


@pytest.mark.slow
def test_overrides_without_config_take_the_keys_of_the_workdirs_saved_config(tmp_path):
  # A section the workdir's config has and configs/default.py lacks can be overridden: the
  # override reaches the run (here, to the missing checkpoint), it is not refused.
  image_folders.make_shapes_folder(str(tmp_path / 'data'), {'train': 4, 'test': 2})
  config = default.get_config()
  config.data_source, config.dataset = 'folder', str(tmp_path / 'data')
  config.preprocess = 'resize(16)'
  config.evaluations = {'holdout': {'split': 'test[:4]'}}
  workdir = tmp_path / 'workdir'
  workdir.mkdir()
  (workdir / workdirs.CONFIG_FILE).write_text(config.to_json())
  result = _main('--mode=eval', '--config.evaluations.holdout.split=test[:6]',
                 f'--workdir={workdir}')
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1].startswith('Checkpoint error: No checkpoint'), (
      result.stderr[-2000:])


def test_a_renamed_key_is_read_under_its_new_name_from_a_workdir_and_refused_in_a_config(
    tmp_path):
  # A workdir trained before config.cpu_kernels became config.kernels resumes, predicts and
  # exports as before; a config file that still sets the old key is refused, naming it.
  (tmp_path / saved_config.CONFIG_FILE).write_text(json.dumps({'cpu_kernels': 'off'}))
  saved = saved_config.with_defaults(str(tmp_path))
  assert saved.kernels == 'stock' and 'cpu_kernels' not in saved
  run_spec.resolve(saved)
  config = default.get_config()
  config.cpu_kernels = 'off'
  with pytest.raises(errors.ConfigError) as error:
    run_spec.resolve(config)
  assert (error.value.key, error.value.value) == ('cpu_kernels', 'off')
