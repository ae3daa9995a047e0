"""TensorBoard summaries: the config as HParams and text, and the eval error images."""

from clu import metric_writers
import numpy as np
from tensorboard.backend.event_processing import event_accumulator

from configs import default
from training import summaries


def test_confusion_matrix_counts_true_by_predicted():
  counts = summaries.confusion_matrix(np.array([0, 1, 1, 2, 2]), np.array([0, 2, 1, 2, 2]), 3)
  np.testing.assert_array_equal(counts, [[1, 0, 0], [0, 1, 1], [0, 0, 2]])


def test_images_are_rgb_and_show_the_examples():
  images = np.zeros((5, 28, 28, 1), np.float32)
  images[:, 10:18, 10:18] = 1.0  # A white square in every example.
  grid = summaries.misclassified_grid(images, np.arange(5), np.arange(5) + 1)
  # 3 columns of 90-pixel cells, 2 rows of 84-pixel examples under an 18-pixel caption.
  assert grid.shape == (2 * 102, 3 * 90, 3) and grid.dtype == np.uint8
  assert (grid == 255).all(axis=-1).sum() > 5 * (8 * 3)**2  # The squares, drawn 3x.
  matrix = summaries.confusion_matrix_image(np.eye(10, dtype=int) * 7)
  assert matrix.shape == (44 + 10 * 36, 44 + 10 * 36, 3) and matrix.dtype == np.uint8


def test_write_config_hparams_and_text(tmp_path):
  config = default.get_config()  # data_dir is an unset placeholder (None): not an hparam.
  writer = metric_writers.create_default_writer(str(tmp_path))
  summaries.write_config(writer, str(tmp_path), config)
  writer.flush()
  accumulator = event_accumulator.EventAccumulator(str(tmp_path))
  accumulator.Reload()
  assert {'config', '_hparams_/experiment', '_hparams_/session_start_info'} <= set(
      accumulator.Tags()['tensors'])
  text = accumulator.Tensors('config')[0].tensor_proto.string_val[0].decode()
  assert 'learning_rate: 0.1' in text
