"""Where metrics go: TensorBoard (the config as HParams and text, pictures) and metrics.jsonl."""

import json
import os

from clu import metric_writers
import numpy as np
from tensorboard.backend.event_processing import event_accumulator

from configs import default
from training import loggers
from training import pictures
from training import run_spec
from training import summaries


def test_misclassified_grid_shows_the_examples_with_their_class_names():
  images = np.zeros((5, 28, 28, 1), np.float32)
  images[:, 10:18, 10:18] = 1.0  # A white square in every example.
  names = ('zero', 'one', 'two', 'three', 'four', 'a very long class name indeed')
  grid = pictures.misclassified_grid(images, np.arange(5), np.arange(5) + 1, names)
  assert grid.ndim == 3 and grid.shape[-1] == 3 and grid.dtype == np.uint8
  assert (grid == 255).all(axis=-1).sum() > 5 * (8 * 3)**2  # The squares, drawn 3x.
  # Normalised images (here in [-2, 2]) are shown over their own range.
  np.testing.assert_array_equal(pictures.displayable(images * 4 - 2), np.uint8(images * 255))


def test_confusion_matrix_picture_for_10_and_100_classes():
  ten = pictures.confusion_matrix(np.eye(10, dtype=int) * 7 + 1, tuple(map(str, range(10))))
  assert ten.dtype == np.uint8 and 400 <= ten.shape[1] <= 700
  hundred = pictures.confusion_matrix(np.eye(100, dtype=int) * 7,
                                      tuple(f'class number {k}' for k in range(100)))
  assert 400 <= hundred.shape[1] <= 800  # Cells shrink: the same card size.
  assert pictures.short_name('a very long class name indeed') == 'a very..indeed'  # 14 chars.


def test_jsonl_writer_and_reader(tmp_path):
  writer = loggers.create_writer('tensorboard|jsonl', str(tmp_path))
  writer.write_scalars(10, {'train/loss': np.float32(0.5), 'epoch': 1})
  writer.write_scalars(10, {'eval/accuracy': 0.9})
  writer.write_scalars(20, {'eval/accuracy': 0.8})
  writer.write_images(20, {'eval/confusion_matrix': np.zeros((1, 4, 4, 3), np.uint8)})
  writer.write_scalars(20, {'eval/accuracy': 0.95})  # A resumed run writes step 20 again.
  writer.close()
  with open(os.path.join(tmp_path, summaries.METRICS_FILE), 'a', encoding='utf-8') as file:
    file.write('{"step": 30, "eval/acc')  # A line cut short by a kill.
  assert summaries.read_metrics(str(tmp_path)) == {
      10: {'train/loss': 0.5, 'epoch': 1, 'eval/accuracy': 0.9}, 20: {'eval/accuracy': 0.95}}
  with open(os.path.join(tmp_path, summaries.METRICS_FILE), encoding='utf-8') as file:
    assert json.loads(file.readline()) == {'step': 10, 'train/loss': 0.5, 'epoch': 1}


def test_write_config_hparams_and_text(tmp_path):
  config = default.get_config()  # data_dir is an unset placeholder (None): not an hparam.
  writer = metric_writers.create_default_writer(str(tmp_path))
  settings = run_spec.resolve(config).settings
  loggers.write_config(writer, str(tmp_path), settings, ['eval/accuracy', 'eval/loss'])
  writer.flush()
  accumulator = event_accumulator.EventAccumulator(str(tmp_path))
  accumulator.Reload()
  assert {'config', '_hparams_/experiment', '_hparams_/session_start_info'} <= set(
      accumulator.Tags()['tensors'])
  text = accumulator.Tensors('config')[0].tensor_proto.string_val[0].decode()
  assert 'learning_rate: 0.1' in text
