"""Predict and export with class names: an image folder -> training -> predict round trip."""

import csv
import os
import subprocess
import sys
import textwrap

import numpy as np
from PIL import Image
import pytest
import tensorflow as tf

from configs import default
from core import errors
from data_sources import base
import image_folders
from modes import evaluate
from modes import export
from modes import predict
import train
from training import workdirs
from training import run_spec
import conftest

CLASSES = ('centre', 'left half', 'top')


def _config(root):
  config = default.get_config()
  config.update(dict(data_source='folder', dataset=root, eval_split='test', batch_size=12,
                     eval_batch_size=10, num_epochs=6, learning_rate=0.05, log_every_steps=6,
                     checkpoint_every_steps=1000, preprocess='resize(16)|translate(1)'))
  config.model_options.cnn.update(conv1_features=8, conv2_features=16, hidden_features=32)
  return config


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A small CNN trained on a generated colour folder (mixed sizes, formats, a corrupt file)."""
  root = str(tmp_path_factory.mktemp('data') / 'shapes')
  files = image_folders.make_shapes_folder(root, {'train': 24, 'test': 8})
  workdir = str(tmp_path_factory.mktemp('workdir'))
  metrics = train.train_and_evaluate(run_spec.resolve(_config(root)), workdir)
  return root, files, workdir, metrics


def _read(path):
  with open(path, newline='', encoding='utf-8') as file:
    return list(csv.reader(file))


def test_predictions_agree_with_eval_and_name_the_classes(trained, capsys):
  root, files, workdir, metrics = trained
  assert metrics['eval/accuracy'] >= 0.6, metrics  # 3 classes: chance is 1/3.
  evaluated = evaluate.evaluate_checkpoint(run_spec.resolve(_config(root)), workdir)
  path = predict.predict(run_spec.resolve(_config(root)), workdir, os.path.join(root, 'test'))
  assert path == os.path.join(workdir, 'predictions.csv')
  header, *rows = _read(path)
  assert header == ['file', 'class', 'probability']
  truth = dict(files['test'])
  assert sorted(row[0] for row in rows) == sorted(truth)
  assert {row[1] for row in rows} <= set(CLASSES)
  assert all(1 / 3 <= float(row[2]) <= 1 for row in rows)
  # The same preprocessing as eval: the file's accuracy is the eval accuracy on those images.
  accuracy = np.mean([truth[file] == name for file, name, _ in rows])
  assert accuracy == pytest.approx(evaluated['eval/accuracy'], abs=1e-6)
  printed = capsys.readouterr().out
  assert 'file' in printed and '(14 more; 24 predictions in' in printed


def test_predict_needs_no_data_skips_unreadable_files_and_takes_globs(trained, tmp_path):
  root, files, workdir, _ = trained
  config = _config(str(tmp_path / 'the_data_is_gone'))  # The saved dataset info suffices.
  path = predict.predict(run_spec.resolve(config), workdir, os.path.join(root, 'train', 'left half'))
  rows = _read(path)[1:]
  assert len(rows) == 24  # broken.png and notes.txt skipped.
  path = predict.predict(run_spec.resolve(config), workdir, os.path.join(root, 'test', '*', '00[01].*'))
  assert len(_read(path)) == 1 + 6


def test_predict_skips_damaged_files_by_name_and_reads_messy_ones(trained, tmp_path, caplog):
  root, _, workdir, _ = trained
  inputs = tmp_path / 'photos'
  (inputs / 'nested').mkdir(parents=True)
  good = sorted(os.path.join(root, 'test', 'top', name)
                for name in os.listdir(os.path.join(root, 'test', 'top')))[:3]
  for index, path in enumerate(good):
    Image.open(path).convert('RGB').save(inputs / 'nested' / f'{index}.png')
  Image.open(good[0]).convert('RGB').save(inputs / 'photo.jpg')
  with open(inputs / 'photo.jpg', 'rb') as file:
    jpeg = file.read()
  (inputs / 'cut.jpg').write_bytes(jpeg[:len(jpeg) // 2])  # A truncated JPEG.
  (inputs / 'empty.png').write_bytes(b'')
  rgba = Image.open(good[1]).convert('RGBA')
  rgba.save(inputs / 'transparent.png')
  path = predict.predict(run_spec.resolve(_config(root)), workdir, str(inputs))
  predicted = {os.path.relpath(row[0], inputs) for row in _read(path)[1:]}
  assert predicted == {'nested/0.png', 'nested/1.png', 'nested/2.png', 'photo.jpg',
                       'transparent.png'}
  assert 'cut.jpg' in caplog.text and 'empty.png' in caplog.text


def test_predict_bad_inputs_are_one_line_errors(trained, tmp_path):
  root, _, workdir, _ = trained
  config = _config(root)
  with pytest.raises(errors.FlagError) as error:
    predict.predict(run_spec.resolve(config), workdir, None)
  assert error.value.flag == 'inputs'
  (tmp_path / 'texts').mkdir()
  (tmp_path / 'texts' / 'a.txt').write_text('not an image')
  with pytest.raises(errors.FlagError) as error:
    predict.predict(run_spec.resolve(config), workdir, str(tmp_path / 'texts'))
  assert error.value.value == str(tmp_path / 'texts')
  # No checkpoint is the first problem reported, before the inputs are looked at.
  empty_workdir = str(tmp_path / 'untrained')
  os.makedirs(empty_workdir)
  with pytest.raises(errors.CheckpointError):
    predict.predict(run_spec.resolve(config), empty_workdir, str(tmp_path / 'texts'))
  # A grayscale model refuses colour images.
  gray_workdir = str(tmp_path / 'gray_model')
  gray_config = _config(root)
  gray_config.model_options.cnn.update(conv1_features=8, conv2_features=16, hidden_features=32)
  os.makedirs(gray_workdir)
  gray_info = base.DatasetInfo(name='digits', image_shape=(16, 16, 1), num_classes=3,
                               num_train_examples=12, num_eval_examples=1, class_names=CLASSES)
  workdirs.save_info(gray_workdir, gray_info)
  state = conftest.create_state(gray_config, gray_info, 1)
  checkpoints = train.checkpointing.Checkpoints(gray_workdir)
  checkpoints.save(1, state, {'epoch': 0, 'step_in_epoch': 1, 'steps_per_epoch': 1,
                              'hooks': {}})
  checkpoints.close()
  with pytest.raises(errors.FlagError) as error:
    predict.predict(run_spec.resolve(gray_config), gray_workdir, os.path.join(root, 'test'))
  assert 'grayscale' in str(error.value)


def test_saved_model_in_plain_tensorflow_classifies_as_predict(trained, tmp_path):
  root, files, workdir, _ = trained
  path = export.export_saved_model(run_spec.resolve(_config(root)), workdir)
  loaded = tf.saved_model.load(path)
  names = loaded.signatures['class_names']()['class_names'].numpy()
  assert tuple(name.decode() for name in names) == CLASSES
  test_files = [file for file, _ in files['test'] if not file.endswith('.gif')]
  predictions = {file: name for file, name, _ in
                 _read(predict.predict(run_spec.resolve(_config(root)), workdir, os.path.join(root, 'test')))[1:]}
  # A plain python with TensorFlow only, on the raw files of mixed sizes, one at a time.
  script = textwrap.dedent(f"""
      import sys
      import tensorflow as tf
      model = tf.saved_model.load({path!r})
      for file in sys.argv[1:]:
        image = tf.io.decode_image(tf.io.read_file(file), channels=3, expand_animations=False)
        print(model.signatures['classify'](images=image[None])['class'].numpy()[0].decode())
      """)
  result = subprocess.run([sys.executable, '-c', script, *test_files], capture_output=True,
                          text=True, timeout=300, check=True)
  assert result.stdout.split('\n')[:-1] == [predictions[file] for file in test_files]
  with pytest.raises(Exception) as error:  # A float input: TF's own one-line signature error.
    loaded.signatures['classify'](images=tf.zeros((1, 16, 16, 3)))
  assert 'uint8' in str(error.value) or 'dtype' in str(error.value)
