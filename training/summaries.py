"""TensorBoard summaries beyond scalars: the config as HParams and text, pictures of eval errors.

The HParams dashboard lists a run when its event files hold a session start (the hparam values)
and, for the metric columns, an experiment config naming the metrics. clu's `write_hparams` only
writes the former (and rejects None values), so both are written here with TensorBoard's API.
"""

import math

from clu import metric_writers
from clu import parameter_overview
import jax
import ml_collections
import numpy as np
from PIL import Image
from PIL import ImageDraw
from PIL import ImageFont
import tensorflow as tf
from tensorboard.plugins.hparams import api as hp

import input_pipeline
from training import parallel

# Scalars written at every eval that the HParams dashboard shows as metric columns.
HPARAMS_METRICS = ('eval_accuracy', 'eval_loss', 'test_accuracy', 'test_loss')
_FONT = ImageFont.load_default(size=12)
_SCALE = 3  # Each example is drawn 3x its size: MNIST digits become 84 x 84 pixels.
_CELL = 36  # Pixels per confusion-matrix cell.


def write_config(writer: metric_writers.MetricWriter, workdir: str,
                 config: ml_collections.ConfigDict) -> None:
  """Writes the resolved config as HParams (with `HPARAMS_METRICS`) and as a text summary."""
  # TensorBoard hparams are bool/int/float/str: tuples are shown as their text, and an unset
  # placeholder (None) has no value to show.
  hparams = {key: str(value) if isinstance(value, (tuple, list)) else value
             for key, value in parameter_overview.flatten_dict(
                 config.to_dict(), delimiter='.').items() if value is not None}
  if jax.process_index() == 0:
    hparams_writer = tf.summary.create_file_writer(workdir)
    with hparams_writer.as_default():
      hp.hparams_config(hparams=[hp.HParam(key) for key in sorted(hparams)],
                        metrics=[hp.Metric(tag) for tag in HPARAMS_METRICS])
      hp.hparams(hparams)
    hparams_writer.close()
  # Indented: markdown renders it as a code block, one `key: value` per line.
  writer.write_texts(0, {'config': '    ' + str(config).replace('\n', '\n    ')})


def real_examples(batches: list[input_pipeline.Batch]) -> tuple[np.ndarray, np.ndarray]:
  """The images and labels of the real (mask 1) examples of `batches`, on the host, in order."""
  masks = [parallel.to_host(batch['mask']) for batch in batches]
  images, labels = (np.concatenate([parallel.to_host(batch[key])[mask]
                                    for batch, mask in zip(batches, masks)])
                    for key in ('image', 'label'))
  return images, labels


def write_eval_images(writer: metric_writers.MetricWriter, step: int, predictions: np.ndarray,
                      examples: tuple[np.ndarray, np.ndarray] | None, num_classes: int,
                      num_misclassified: int) -> None:
  """Writes a confusion matrix and a grid of the first `num_misclassified` eval errors.

  `examples` are the `real_examples` of the eval batches (unused, and may be None, when
  `num_misclassified` is 0); `predictions` are those of `train.evaluate` for them, in order.
  """
  if num_misclassified == 0:
    return
  images, labels = examples
  wrong = np.flatnonzero(predictions != labels)[:num_misclassified]
  pictures = {'eval_confusion_matrix': confusion_matrix_image(
      confusion_matrix(labels, predictions, num_classes))}
  if len(wrong):
    pictures['eval_misclassified'] = misclassified_grid(images[wrong], labels[wrong],
                                                        predictions[wrong])
  writer.write_images(step, pictures)


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray,
                     num_classes: int) -> np.ndarray:
  """(num_classes, num_classes) counts: row = true class, column = predicted class."""
  return np.bincount(labels * num_classes + predictions,
                     minlength=num_classes**2).reshape(num_classes, num_classes)


def misclassified_grid(images: np.ndarray, labels: np.ndarray,
                       predictions: np.ndarray) -> np.ndarray:
  """A uint8 RGB grid of `images` (N, H, W, C) in [0, 1], each captioned 'pred P, true T'."""
  num, height, width, _ = images.shape
  columns = math.ceil(math.sqrt(num))
  cell_width, cell_height = max(width * _SCALE, 90), height * _SCALE + 18
  grid = Image.new('RGB', (columns * cell_width, math.ceil(num / columns) * cell_height), 'white')
  draw = ImageDraw.Draw(grid)
  for i, (image, label, predicted) in enumerate(zip(images, labels, predictions)):
    x, y = i % columns * cell_width, i // columns * cell_height
    pixels = np.uint8(np.round(image * 255))
    tile = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels).convert('RGB')
    grid.paste(tile.resize((width * _SCALE, height * _SCALE), Image.NEAREST),
               (x + (cell_width - width * _SCALE) // 2, y + 16))
    draw.text((x + 4, y + 1), f'pred {predicted}, true {label}', fill='firebrick', font=_FONT)
  return np.asarray(grid)


def confusion_matrix_image(counts: np.ndarray) -> np.ndarray:
  """A uint8 RGB heat map of `counts`: rows true, columns predicted, shaded by row share."""
  num_classes = len(counts)
  margin = 44  # Room for the axis titles and class indices.
  size = margin + num_classes * _CELL
  image = Image.new('RGB', (size, size), 'white')
  draw = ImageDraw.Draw(image)
  draw.text((margin, 2), 'predicted', fill='black', font=_FONT)
  draw.text((2, margin - 16), 'true', fill='black', font=_FONT)
  shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
  for k in range(num_classes):
    draw.text((margin + k * _CELL + _CELL // 3, 22), str(k), fill='black', font=_FONT)
    draw.text((24, margin + k * _CELL + _CELL // 3), str(k), fill='black', font=_FONT)
  for (true, predicted), count in np.ndenumerate(counts):
    # Correct predictions in blue, errors in red; the darker, the larger the share of the row.
    shade = int(255 * (1 - shares[true, predicted]))
    fill = (shade, shade, 255) if true == predicted else (255, shade, shade)
    box = (margin + predicted * _CELL, margin + true * _CELL)
    draw.rectangle((*box, box[0] + _CELL - 1, box[1] + _CELL - 1), fill=fill, outline='lightgray')
    draw.text((box[0] + 3, box[1] + _CELL // 3), str(count),
              fill='white' if shade < 128 else 'black', font=_FONT)
  return np.asarray(image)
