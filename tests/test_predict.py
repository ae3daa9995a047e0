"""Predict and export with class names: an image folder -> training -> predict round trip."""

import csv
import os

import numpy as np
import pytest
import tensorflow as tf

from configs import default
import data_sources
from data_sources import base
from data_sources import folder_source
import image_folders
import input_pipeline
from modes import evaluate
from modes import export
from modes import predict
from training import config_checks
import train

CLASSES = ('centre', 'left half', 'top')


def _config(root):
  config = default.get_config()
  config.update(dict(data_source='folder', dataset=root, eval_split='test', image_size=16,
                     batch_size=12, eval_batch_size=10, num_epochs=6, learning_rate=0.05,
                     log_every_steps=6, checkpoint_every_steps=1000, augment='translate(1)'))
  config.model_options.cnn.update(conv1_features=8, conv2_features=16, hidden_features=32)
  return config


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A small CNN trained on a generated colour folder (mixed sizes, formats, a corrupt file)."""
  root = str(tmp_path_factory.mktemp('data') / 'shapes')
  files = image_folders.make_shapes_folder(root, {'train': 24, 'test': 8})
  workdir = str(tmp_path_factory.mktemp('workdir'))
  metrics = train.train_and_evaluate(_config(root), workdir)
  return root, files, workdir, metrics


def _read(path):
  with open(path, newline='', encoding='utf-8') as file:
    return list(csv.reader(file))


def test_predictions_agree_with_eval_and_name_the_classes(trained, capsys):
  root, files, workdir, metrics = trained
  assert metrics['eval_num_examples'] == 24
  assert metrics['eval_accuracy'] >= 0.6, metrics  # 3 classes: chance is 1/3.
  evaluated = evaluate.evaluate_checkpoint(_config(root), workdir)
  path = predict.predict(_config(root), workdir, os.path.join(root, 'test'))
  assert path == os.path.join(workdir, 'predictions.csv')
  header, *rows = _read(path)
  assert header == ['file', 'class', 'probability']
  truth = dict(files['test'])
  assert sorted(row[0] for row in rows) == sorted(truth)
  assert {row[1] for row in rows} <= set(CLASSES)
  assert all(1 / 3 <= float(row[2]) <= 1 for row in rows)
  # The same preprocessing as eval: the file's accuracy is the eval accuracy on those images.
  accuracy = np.mean([truth[file] == name for file, name, _ in rows])
  assert accuracy == pytest.approx(evaluated['eval_accuracy'], abs=1e-6)
  printed = capsys.readouterr().out
  assert 'file' in printed and '(14 more; 24 predictions in' in printed


def test_predict_needs_no_data_skips_unreadable_files_and_takes_globs(trained, tmp_path):
  root, files, workdir, _ = trained
  config = _config(str(tmp_path / 'the_data_is_gone'))  # The saved dataset info suffices.
  path = predict.predict(config, workdir, os.path.join(root, 'train', 'left half'))
  rows = _read(path)[1:]
  assert len(rows) == 24  # broken.png and notes.txt skipped.
  path = predict.predict(config, workdir, os.path.join(root, 'test', '*', '00[01].*'))
  assert len(_read(path)) == 1 + 6


def test_predict_bad_inputs_are_one_line_errors(trained, tmp_path):
  root, _, workdir, _ = trained
  config = _config(root)
  with pytest.raises(config_checks.ConfigError, match='--mode=predict needs --inputs=PATH'):
    predict.predict(config, workdir, None)
  (tmp_path / 'texts').mkdir()
  (tmp_path / 'texts' / 'a.txt').write_text('not an image')
  with pytest.raises(config_checks.ConfigError,
                     match=r"No image under --inputs='.*texts' \(only 1 unreadable files\)"):
    predict.predict(config, workdir, str(tmp_path / 'texts'))
  # A grayscale model refuses colour images (checked before any checkpoint is read).
  gray_workdir = str(tmp_path / 'gray_model')
  os.makedirs(gray_workdir)
  data_sources.save_info(gray_workdir, base.DatasetInfo(
      name='digits', image_shape=(16, 16, 1), num_classes=3, num_train_examples=1,
      num_eval_examples=1, class_names=CLASSES))
  with pytest.raises(config_checks.ConfigError,
                     match=r'--inputs has \d+ colour images \(.*\) but the model takes '
                           'grayscale images'):
    predict.predict(config, gray_workdir, os.path.join(root, 'test'))


def test_saved_model_carries_the_class_names(trained):
  root, files, workdir, _ = trained
  path = export.export_saved_model(_config(root), workdir)
  loaded = tf.saved_model.load(path)
  names = loaded.signatures['class_names']()['class_names'].numpy()
  assert tuple(name.decode() for name in names) == CLASSES
  predictions = {file: name for file, name, _ in
                 _read(predict.predict(_config(root), workdir, os.path.join(root, 'test')))[1:]}
  test_files = [file for file, _ in files['test']]
  images = tf.stack([input_pipeline.resize(folder_source.decode(tf.constant(file), 3), (16, 16))
                     for file in test_files])
  classified = loaded.signatures['classify'](images=tf.cast(images, tf.float32) / 255.0)
  got = [name.decode() for name in classified['class'].numpy()]
  assert got == [predictions[file] for file in test_files]
  assert np.all(classified['probability'].numpy() >= 1 / 3)

