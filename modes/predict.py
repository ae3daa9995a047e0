"""Predict mode: classifies image files with a checkpoint, into a CSV of class names.

    python main.py --workdir=runs/mnist --mode=predict --inputs=PATH [--checkpoint=best]

PATH is an image file, a directory (searched recursively) or a glob pattern. Every image is
preprocessed as the eval images were: decoded as training decodes image folders (a GIF's first
frame, EXIF orientation applied, transparency composited onto white), given the model's
channels (a grayscale image is converted for a colour model; a colour image for a grayscale
model is refused), resized and scaled by `config.preprocess`. Files that are not readable
JPEG/PNG/BMP/GIF images are skipped with one warning naming them. `<workdir>/predictions.csv`
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
import numpy as np
import tensorflow as tf

from core import errors
from data_sources import folder_source
import modes
from training import run_spec

PREDICTIONS_FILE = 'predictions.csv'
_PRINTED_ROWS = 10
_NAMED_FILES = 3  # Files named in an error.


def find_inputs(inputs: str) -> list[str]:
  """The files that `inputs` names: itself, the files under a directory, or a glob's matches."""
  if os.path.isdir(inputs):
    return folder_source.find_files(inputs)
  if os.path.isfile(inputs):
    return [inputs]
  return sorted(path for path in glob.glob(inputs, recursive=True) if os.path.isfile(path))


@nnx.jit
def _probabilities(model: nnx.Module, images: jax.Array) -> jax.Array:
  return jax.nn.softmax(model(images).astype(jax.numpy.float32))


def predict(run: run_spec.Run, workdir: str, inputs: str | None,
            checkpoint: str = 'latest') -> str:
  """Writes the predicted class of each image under `inputs` to <workdir>/predictions.csv."""
  if not inputs:
    raise errors.FlagError(
        '--mode=predict needs --inputs=PATH: an image file, a directory of images (searched '
        'recursively) or a glob pattern such as "photos/*.jpg".', flag='inputs', value=inputs)
  info = modes.dataset_info(run, workdir)
  model, step = modes.load_model(run, workdir, info, checkpoint)
  headers, skipped = folder_source.read_headers(find_inputs(inputs))
  if not headers:
    found = f' (only {len(skipped)} unreadable files)' if skipped else ''
    raise errors.FlagError(
        f'No image under --inputs={inputs!r}{found}: pass an image file, a directory of '
        f'{"/".join(folder_source.FORMATS)} images or a glob that matches some.',
        flag='inputs', value=inputs)
  height, width, channels = info.image_shape
  colour = [header.path for header in headers if not header.gray]
  if channels == 1 and colour:
    named = ', '.join(colour[:_NAMED_FILES]) + (', ...' if len(colour) > _NAMED_FILES else '')
    raise errors.FlagError(
        f'--inputs has {len(colour)} colour images ({named}) but the model takes grayscale '
        'images: convert them to grayscale, or use a model trained on colour images.',
        flag='inputs', value=inputs)
  logging.info('Predicting %d images with the checkpoint at step %d.', len(headers), step)
  preprocess = run.input.preprocess

  def prepared(path, orientation, alpha) -> dict[str, tf.Tensor]:
    image = preprocess.resize(folder_source.decode(path, channels, orientation, alpha),
                              (height, width))
    return {'path': path, 'image': tf.ensure_shape(image, info.image_shape)}

  # A file that passes the header check but fails to decode is dropped, not fatal: the paths
  # that come out say which.
  batches = (tf.data.Dataset.from_tensor_slices((
      [header.path for header in headers], [header.orientation for header in headers],
      [header.alpha for header in headers]))
             .map(prepared, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
             .ignore_errors()
             .batch(run.eval_batch_size)
             .map(lambda batch: {**batch, 'image': preprocess.eval_batch(batch['image'])})
             .prefetch(1))
  paths, probabilities = [], []
  for batch in batches.as_numpy_iterator():
    paths += [path.decode() for path in batch['path']]
    probabilities.append(np.asarray(_probabilities(model, batch['image'])))
  decoded = set(paths)
  folder_source.warn_skipped(skipped + [header.path for header in headers
                                        if header.path not in decoded])
  probabilities = np.concatenate(probabilities) if probabilities else np.zeros((0, 1))
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
