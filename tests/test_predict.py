"""Predict with class names: an image folder -> training -> predict round trip."""

import csv
import json
import logging
import os

import numpy as np
from PIL import Image
import pytest

from configs import default
from core import errors
from data_sources import base
import image_folders
from modes import evaluate
from modes import predict
import train
from training import calibration
from training import workdirs
from training import run_spec
from tests.helpers import build

CLASSES = ('centre', 'left half', 'top')


def _config(root):
  config = default.get_config()
  config.update(dict(data_source='folder', dataset=root, eval_split='test', batch_size=12,
                     eval_batch_size=10, num_epochs=6, learning_rate=0.05, log_every_steps=6,
                     checkpoint_every_steps=1000, preprocess='resize(16)|translate(1)',
                     temperature_scaling=True))
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
  # The report without naming its evaluators (the config's lack per_class and ece): per-class
  # rows and the confusion matrix as a picture beside the JSON.
  step = json.loads(open(os.path.join(workdir, 'metrics.jsonl')).readlines()[-1])['step']
  with open(evaluate.report_path(workdir, 'test', step, 'csv'), newline='') as file:
    assert [row['class'] for row in csv.DictReader(file)] == list(CLASSES)
  picture = Image.open(evaluate.report_path(workdir, 'test', step, 'png', 'confusion_matrix'))
  assert picture.mode == 'RGB' and min(picture.size) > 100
  assert 'eval/macro_f1' in evaluated


def test_the_fitted_temperature_lowers_the_nll_and_keeps_the_classes(trained, tmp_path):
  root, files, workdir, _ = trained
  saved = json.loads(open(os.path.join(workdir, calibration.TEMPERATURE_FILE)).read())
  assert saved['split'] == 'test' and saved['temperature'] != pytest.approx(1.0, abs=1e-3)
  raw_config = _config(root)
  raw_config.temperature_scaling = False  # The logits as they are.
  scaled = evaluate.evaluate_checkpoint(run_spec.resolve(_config(root)), workdir)
  raw = evaluate.evaluate_checkpoint(run_spec.resolve(raw_config), workdir)
  # Fitted on this split: its NLL is lower with T than without, as the fit recorded.
  assert scaled['eval/loss'] < raw['eval/loss']
  assert scaled['eval/loss'] == pytest.approx(saved['nll_after'], rel=1e-4)
  assert raw['eval/loss'] == pytest.approx(saved['nll_before'], rel=1e-4)
  assert scaled['eval/accuracy'] == raw['eval/accuracy']
  test_images = os.path.join(root, 'test')
  scaled_rows = _read(predict.predict(run_spec.resolve(_config(root)), workdir, test_images))[1:]
  raw_rows = _read(predict.predict(run_spec.resolve(raw_config), workdir, test_images))[1:]
  assert [row[:2] for row in scaled_rows] == [row[:2] for row in raw_rows]
  assert [row[2] for row in scaled_rows] != [row[2] for row in raw_rows]


def test_top_k_tta_csv_lists_and_progress(trained, tmp_path, monkeypatch, caplog):
  root, files, workdir, _ = trained
  run = run_spec.resolve(_config(root))
  test_images = os.path.join(root, 'test')
  top1 = {row[0]: row[1:] for row in _read(predict.predict(run, workdir, test_images))[1:]}
  monkeypatch.setattr(predict, 'PROGRESS_SECONDS', 0.0)  # A line after every batch but the 1st.
  with caplog.at_level(logging.INFO, logger='absl'):  # absl's level may be set by now.
    header, *rows = _read(predict.predict(run, workdir, test_images, top_k=3))
  assert header == ['file', 'class_1', 'probability_1', 'class_2', 'probability_2', 'class_3',
                    'probability_3']
  for file, *ranks in rows:
    names, probabilities = ranks[0::2], [float(value) for value in ranks[1::2]]
    assert [names[0], ranks[1]] == top1[file] and sorted(names) == sorted(CLASSES)
    assert probabilities == sorted(probabilities, reverse=True)
    assert sum(probabilities) == pytest.approx(1, abs=1e-5)  # All 3 classes.
  # 24 images in batches of 10: the rate and ETA after the 2nd batch, none after the last.
  progress = [line for line in caplog.messages if line.startswith('predicted ')]
  assert len(progress) == 1 and progress[0].startswith('predicted 20/24 images (83.3%)')
  assert 'ETA' in progress[0]
  flipped = _read(predict.predict(run, workdir, test_images, tta='flip'))[1:]
  assert [row[0] for row in flipped] == list(top1)
  assert [row[2] for row in flipped] != [top1[row[0]][1] for row in flipped]
  # A CSV list: a header naming the path column, paths relative to the CSV or absolute, in its
  # order; a path that is no image is skipped with the warning.
  listed = [file for file, _ in files['test'][:3]]
  lines = (['label,path'] + [f'x,{os.path.relpath(file, tmp_path)}' for file in listed[:2]]
           + [f'x,{listed[2]}', 'x,missing.png'])
  (tmp_path / 'list.csv').write_text('\n'.join(lines) + '\n')
  rows = _read(predict.predict(run, workdir, str(tmp_path / 'list.csv')))[1:]
  assert [os.path.normpath(row[0]) for row in rows] == listed
  assert [row[1:] for row in rows] == [top1[file] for file in listed]
  assert 'missing.png' in caplog.text
  # Without a header: the first column.
  (tmp_path / 'bare.csv').write_text('\n'.join(listed) + '\n')
  assert [row[0] for row in _read(predict.predict(run, workdir, str(tmp_path / 'bare.csv')))[1:]
          ] == listed
  for name, content in (('empty.csv', ''), ('blank.csv', 'file,label\n,3\n'),
                        ('binary.csv', b'\xff\xfe\x00bad')):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(errors.FlagError) as error:
      predict.predict(run, workdir, str(path))
    assert (error.value.flag, error.value.value) == ('inputs', str(path))
  for top_k in (0, 4):
    with pytest.raises(errors.FlagError) as error:
      predict.predict(run, workdir, test_images, top_k=top_k)
    assert (error.value.flag, error.value.value) == ('top_k', top_k)


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
  state = build.create_state(gray_config, gray_info, 1)
  checkpoints = train.checkpointing.Checkpoints(gray_workdir)
  checkpoints.save(1, state, {'epoch': 0, 'step_in_epoch': 1, 'steps_per_epoch': 1,
                              'hooks': {}})
  checkpoints.close()
  with pytest.raises(errors.FlagError) as error:
    predict.predict(run_spec.resolve(gray_config), gray_workdir, os.path.join(root, 'test'))
  assert 'grayscale' in str(error.value)


