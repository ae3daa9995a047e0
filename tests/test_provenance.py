"""Provenance (training/provenance.py): versions, git state and the data's fingerprint in every
workdir; a resumed run on other data says what changed, in one line, and keeps the old record."""

import logging
import os
import shutil
import subprocess

import pytest

from configs import default
from data_sources import base
import image_folders
from training import provenance
from training import run_spec

CLASSES = ('centre', 'left half', 'top')


def _run(root: str) -> run_spec.Run:
  config = default.get_config()
  config.update(dict(data_source='folder', dataset=root, eval_split='test'))
  return run_spec.resolve(config)


def _info(num_train: int) -> base.DatasetInfo:
  return base.DatasetInfo(name='shapes', image_shape=(16, 16, 3), num_classes=3,
                          num_train_examples=num_train, num_eval_examples=6,
                          class_names=CLASSES)


@pytest.fixture(name='root')
def fixture_root(tmp_path) -> str:
  root = str(tmp_path / 'shapes')
  image_folders.make_shapes_folder(root, {'train': 3, 'test': 2}, corrupt=False)
  return root


def test_a_record_names_versions_git_and_data(root, tmp_path):
  record = provenance.record_start(str(tmp_path), _run(root), _info(9))
  assert provenance.records(str(tmp_path)) == [record]
  assert set(record['packages']) == set(provenance.PACKAGES)
  assert all(record['packages'].values())
  data = record['data']
  assert (data['source'], data['dataset'], data['class_names']) == ('folder', root,
                                                                    list(CLASSES))
  assert data['splits'] == {'train': 9, 'test': 6}
  # The hash of the file list: the same for a moved copy, another with a file more.
  moved = str(tmp_path / 'moved')
  shutil.copytree(root, moved)
  assert provenance.data_fingerprint(_run(moved), _info(9))['files_sha256'] == (
      data['files_sha256'])
  top = os.path.join(moved, 'test', 'top')
  shutil.copy(os.path.join(top, sorted(os.listdir(top))[0]), os.path.join(top, 'extra.png'))
  assert provenance.data_fingerprint(_run(moved), _info(9))['files_sha256'] != (
      data['files_sha256'])


def test_other_data_on_resume_is_one_warning_and_the_first_record_stays(root, tmp_path,
                                                                          caplog):
  workdir = str(tmp_path / 'workdir')
  os.makedirs(workdir)
  first = provenance.record_start(workdir, _run(root), _info(9))
  with caplog.at_level(logging.WARNING):
    provenance.record_start(workdir, _run(root), _info(9))
  assert not [record for record in caplog.records if record.levelno >= logging.WARNING]
  with caplog.at_level(logging.WARNING):
    provenance.record_start(workdir, _run(root), _info(8))
  warning, = [record for record in caplog.records if record.levelno >= logging.WARNING]
  assert 'splits: {"test": 6, "train": 9} -> {"test": 6, "train": 8}' in warning.getMessage()
  records = provenance.records(workdir)
  assert len(records) == 3 and records[0] == first


def test_git_state_of_a_checkout_and_of_a_plain_directory(tmp_path):
  assert provenance.git_state(str(tmp_path)) is None
  def git(*args):
    subprocess.run(['git', '-C', str(tmp_path), '-c', 'user.name=t', '-c', 'user.email=t@t',
                    *args], check=True, capture_output=True)
  git('init', '-q')
  (tmp_path / 'code.py').write_text('a = 1\n')
  git('add', 'code.py')
  git('commit', '-q', '-m', 'code')
  (tmp_path / 'runs').mkdir()  # An untracked workdir does not make the checkout dirty.
  (tmp_path / 'runs' / 'metrics.jsonl').write_text('{}\n')
  state = provenance.git_state(str(tmp_path))
  assert len(state['commit']) == 40 and not state['dirty']
  (tmp_path / 'code.py').write_text('a = 2\n')
  assert provenance.git_state(str(tmp_path))['dirty']


@pytest.mark.slow
def test_training_records_its_provenance(root, tmp_path):
  import train  # pylint: disable=g-import-not-at-top  (in-process training, slow tier only)
  config = default.get_config()
  config.update(dict(data_source='folder', dataset=root, eval_split='test', batch_size=3,
                     eval_batch_size=3, num_epochs=1, preprocess='resize(16)'))
  config.model_options.cnn.update(conv1_features=4, conv2_features=8, hidden_features=16)
  workdir = str(tmp_path / 'workdir')
  train.train_and_evaluate(run_spec.resolve(config), workdir)
  record, = provenance.records(workdir)
  assert record['data']['files_sha256'] == provenance.data_fingerprint(
      run_spec.resolve(config), _info(9))['files_sha256']
  # The code's checkout (its commit may move on while the test runs, as others commit).
  assert len(record['git']['commit']) == 40 and isinstance(record['git']['dirty'], bool)
