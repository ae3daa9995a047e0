"""Predict mode: classifies image files with the latest checkpoint, into a CSV of class names.

    python main.py --config=configs/default.py --workdir=runs/mnist --mode=predict --inputs=PATH

PATH is an image file, a directory (searched recursively) or a glob pattern. Every image is
preprocessed as the training images were: decoded (a GIF's first frame), given the model's
channels (a grayscale image is converted for a colour model; a colour image for a grayscale
model is refused), resized to the model's input size and scaled to [0, 1]. Files that are not
readable JPEG/PNG/BMP/GIF images are skipped with one warning. `<workdir>/predictions.csv`
gets one row per image: `file,class,probability` (the class name and its softmax probability).
The class names and input shape come from the dataset info that training saved in the workdir,
so the training data is not needed.
"""

import csv
import glob
import os

from absl import logging
from flax import nnx
import jax
import ml_collections
import numpy as np
import tensorflow as tf

import data_sources
from data_sources import base
from data_sources import folder_source
import input_pipeline
from training import checkpointing
from training import config_checks

PREDICTIONS_FILE = 'predictions.csv'
_PRINTED_ROWS = 10
_NAMED_FILES = 3  # Files named in an error.


def checked_workdir_info(config: ml_collections.ConfigDict, workdir: str) -> base.DatasetInfo:
  """Checks `config` and returns the dataset info of `workdir` (from the data if none is saved)."""
  saved = os.path.exists(os.path.join(workdir, data_sources.INFO_FILE))
  config_checks.check_config(config, data_source=not saved)
  return data_sources.workdir_info(config, workdir)


def find_inputs(inputs: str) -> list[str]:
  """The files that `inputs` names: itself, the files under a directory, or a glob's matches."""
  if os.path.isdir(inputs):
    return sorted(os.path.join(folder, file) for folder, subfolders, files in os.walk(inputs)
                  for file in files if not file.startswith('.'))
  if os.path.isfile(inputs):
    return [inputs]
  return sorted(path for path in glob.glob(inputs, recursive=True) if os.path.isfile(path))


@nnx.jit
def _probabilities(model: nnx.Module, images: jax.Array) -> jax.Array:
  return jax.nn.softmax(model(images))


def predict(config: ml_collections.ConfigDict, workdir: str, inputs: str | None,
            checkpoint: str = 'latest') -> str:
  """Writes the predicted class of each image under `inputs` to <workdir>/predictions.csv."""
  if not inputs:
    raise config_checks.ConfigError(
        '--mode=predict needs --inputs=PATH: an image file, a directory of images (searched '
        'recursively) or a glob pattern such as "photos/*.jpg".')
  info = checked_workdir_info(config, workdir)
  headers, skipped = folder_source.read_headers(find_inputs(inputs))
  folder_source.warn_skipped(skipped)
  if not headers:
    found = f' (only {len(skipped)} unreadable files)' if skipped else ''
    raise config_checks.ConfigError(
        f'No image under --inputs={inputs!r}{found}: pass an image file, a directory of '
        f'{"/".join(folder_source.FORMATS)} images or a glob that matches some.')
  height, width, channels = info.image_shape
  colour = [header.path for header in headers if not header.gray]
  if channels == 1 and colour:
    named = ', '.join(colour[:_NAMED_FILES]) + (', ...' if len(colour) > _NAMED_FILES else '')
    raise config_checks.ConfigError(
        f'--inputs has {len(colour)} colour images ({named}) but the model takes grayscale '
        'images: convert them to grayscale, or use a model trained on colour images.')
  model, step = checkpointing.load_model(config, workdir, info, checkpoint)
  logging.info('Predicting %d images with the checkpoint at step %d.', len(headers), step)

  def preprocess(path: tf.Tensor) -> tf.Tensor:
    image = input_pipeline.resize(folder_source.decode(path, channels), (height, width))
    return tf.cast(tf.ensure_shape(image, info.image_shape), tf.float32) / 255.0

  paths = [header.path for header in headers]
  batches = (tf.data.Dataset.from_tensor_slices(paths)
             .map(preprocess, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
             .batch(config.eval_batch_size).prefetch(1))
  probabilities = np.concatenate([np.asarray(_probabilities(model, images))
                                  for images in batches.as_numpy_iterator()])
  rows = [(path, info.class_names[label], float(row[label]))
          for path, row, label in zip(paths, probabilities, probabilities.argmax(axis=1))]
  path = os.path.join(workdir, PREDICTIONS_FILE)
  with open(path, 'w', newline='', encoding='utf-8') as file:
    writer = csv.writer(file)
    writer.writerow(('file', 'class', 'probability'))
    writer.writerows((file, name, f'{probability:.6f}') for file, name, probability in rows)
  _print_table(rows, path)
  return path


def _print_table(rows: list[tuple[str, str, float]], path: str) -> None:
  shown = rows[:_PRINTED_ROWS]
  file_width = max(len('file'), *(len(file) for file, _, _ in shown))
  class_width = max(len('class'), *(len(name) for _, name, _ in shown))
  print(f'{"file":<{file_width}}  {"class":<{class_width}}  probability')
  for file, name, probability in shown:
    print(f'{file:<{file_width}}  {name:<{class_width}}  {probability:.4f}')
  more = f'{len(rows) - len(shown)} more; ' if len(rows) > len(shown) else ''
  print(f'({more}{len(rows)} predictions in {path})')
