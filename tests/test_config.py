"""Bad input fails fast, before any data is read, with a message naming the value and the fix."""

import glob
import importlib
import os
import subprocess
import sys

import pytest

from training import config_checks
import train
from configs import default

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize('key,value,message', [
    ('dataset', 'mnistt', r"Unknown dataset 'mnistt'"),
    ('model', 'resnet50', r"Unknown model 'resnet50'.*\['cnn', 'mlp', 'resnet'\]"),
    ('optimizer', 'sgdd', r"Unknown optimizer 'sgdd'.*\['adam', 'adamw', 'sgd', 'sgd_l2'\]"),
    ('schedule', 'linear', r"Unknown schedule 'linear'.*\['constant', 'cosine', 'warmup_cosine'\]"),
    ('batch_size', 0, r'config.batch_size=0 is invalid: it must be an integer >= 1'),
    ('batch_size', -5, r'config.batch_size=-5 is invalid'),
    ('num_epochs', 0, r'config.num_epochs=0 is invalid: it must be an integer >= 1'),
    ('learning_rate', 0.0, r'config.learning_rate=0.0 is invalid: it must be > 0'),
    ('learning_rate', -0.1, r'config.learning_rate=-0.1 is invalid'),
    ('eval_batch_size', 0, r'config.eval_batch_size=0 is invalid'),
    ('num_misclassified_images', -1, r'config.num_misclassified_images=-1 is invalid: it must '
     r'be an integer >= 0'),
    ('checkpoint_every_steps', 0, r'config.checkpoint_every_steps=0 is invalid: it must be an '
                                  r'integer >= 1'),
    ('max_checkpoints_to_keep', 0, r'config.max_checkpoints_to_keep=0 is invalid'),
    ('cpu_kernels', 'on', r"Unknown cpu_kernels 'on'.*\['auto', 'off'\]"),
    ('model_options', {'cnn': {'dropout': 0.1}}, r'config.model_options.cnn.dropout is not an '
     r"option of model 'cnn' \(CNN\); its options: conv1_features, conv2_features, "
     r'hidden_features, dropout_rate'),
])
def test_bad_values_fail_before_data_is_read(tmp_path, key, value, message):
  config = default.get_config()
  config[key] = value
  # A data dir that does not exist: reading data would fail differently.
  config.data_dir = str(tmp_path / 'no_data_here')
  with pytest.raises(config_checks.ConfigError, match=message):
    train.train_and_evaluate(config, str(tmp_path / 'workdir'))
  assert not (tmp_path / 'no_data_here').exists()


@pytest.mark.parametrize('path', sorted(glob.glob(os.path.join(ROOT, 'configs', '*.py'))))
def test_every_shipped_config_passes_the_checks(path):
  config = importlib.import_module(f'configs.{os.path.basename(path)[:-3]}').get_config()
  config_checks.check_config(config)
  image_shape = (32, 32, 3) if 'cifar' in path else (28, 28, 1)
  config_checks.check_augment(config, image_shape)


def test_batch_larger_than_train_split():
  config = default.get_config()
  config.batch_size = 70_000
  with pytest.raises(config_checks.ConfigError,
                     match=r'batch_size=70000 is larger than the 60000 examples.*\[1, 60000\]'):
    config_checks.check_against_data(config, 60_000)


def test_unwritable_workdir(tmp_path):
  blocker = tmp_path / 'a_file'
  blocker.write_text('not a directory')
  with pytest.raises(config_checks.ConfigError, match=r'a_file/runs.*not writable'):
    config_checks.check_workdir(str(blocker / 'runs'))


def _main(*args):
  return subprocess.run([sys.executable, 'main.py', *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)


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
     'Config error: --mode=predict needs --inputs=PATH'),
    (['--config=configs/default.py', '--config.data_source=folder',
      '--config.dataset=/no/such/folder'],
     "Config error: Image folder '/no/such/folder' is not a directory"),
])
def test_cli_mistakes_end_in_one_line(tmp_path, args, line):
  result = _main(*args, f'--workdir={tmp_path}')
  assert result.returncode == 1
  assert 'Traceback' not in result.stderr
  assert result.stderr.strip().splitlines()[-1].startswith(line), result.stderr[-2000:]
