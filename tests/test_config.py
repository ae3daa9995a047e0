"""Bad input fails fast, before any data is read, with a message naming the value and the fix."""

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
    ('model', 'resnet', r"Unknown model 'resnet'.*\['cnn', 'mlp'\]"),
    ('optimizer', 'sgdd', r"Unknown optimizer 'sgdd'.*\['adam', 'adamw', 'sgd'\]"),
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
])
def test_bad_values_fail_before_data_is_read(tmp_path, key, value, message):
  config = default.get_config()
  config[key] = value
  # A data dir that does not exist: reading data would fail differently.
  config.data_dir = str(tmp_path / 'no_data_here')
  with pytest.raises(config_checks.ConfigError, match=message):
    train.train_and_evaluate(config, str(tmp_path / 'workdir'))
  assert not (tmp_path / 'no_data_here').exists()


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


def test_cli_missing_config_file(tmp_path):
  result = _main('--config=configs/nope.py', f'--workdir={tmp_path}')
  assert result.returncode != 0
  assert 'configs/nope.py' in result.stderr


def test_cli_mistyped_override_names_the_key(tmp_path):
  result = _main('--config=configs/default.py', f'--workdir={tmp_path}',
                 '--config.learnin_rate=0.1')
  assert result.returncode != 0
  assert 'learnin_rate' in result.stderr


def test_cli_bad_value_exits_nonzero_with_message(tmp_path):
  result = _main('--config=configs/default.py', f'--workdir={tmp_path}',
                 '--config.num_epochs=0')
  assert result.returncode == 1
  assert 'Config error: config.num_epochs=0 is invalid' in result.stderr
