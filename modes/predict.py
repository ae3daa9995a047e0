"""Predict mode: classifies image files with a checkpoint, into a CSV of class names.

    python main.py --workdir=runs/mnist --mode=predict --inputs=PATH [--checkpoint=best]
        [--top_k=N] [--tta=flip]

PATH is an image file, a directory (searched recursively), a glob pattern, or a `.csv` file
listing images: its first column, or its column named `file` or `path`, holds paths relative to
the CSV's directory or absolute (a first row that names no file, such as `image,label`, is a
header). Every image is preprocessed as the eval images were: decoded as training decodes image
folders (a GIF's first frame, EXIF orientation applied, transparency composited onto white),
given the model's channels (a grayscale image is converted for a colour model; a colour image
for a grayscale model is refused), resized by `config.preprocess` and, as uint8, scaled with the
model in one compiled program. Files that are not
readable JPEG/PNG/BMP/GIF images are skipped with one warning naming them.

`<workdir>/predictions.csv` gets one row per image: `file,class,probability` (the class name and
its softmax probability), or with `--top_k=N` > 1 `file,class_1,probability_1,...,class_N,
probability_N` (the N most probable classes, most probable first). The probabilities are those
of the workdir's fitted temperature when config.temperature_scaling is on, and with `--tta=flip`
the mean over each image and its left-right mirror. A long predict logs a progress line every
10 s with an ETA. The class names and input shape come from the dataset info that training saved
in the workdir, so the training data is not needed.
"""

import csv
import functools
import glob
import os
import time
from collections.abc import Callable
from typing import NamedTuple

from absl import logging
from flax import nnx
import jax
import numpy as np
import tensorflow as tf

from core import cli
from core import config_values
from core import errors
from core import progress
from data_sources import base
from data_sources import image_files
import modes
import preprocessing
from training import calibration
from training import run_spec

PREDICTIONS_FILE = 'predictions.csv'
_PRINTED_ROWS = 10
_NAMED_FILES = 3  # Files named in an error.
PROGRESS_SECONDS = 10.0  # A progress line at most this often.
_PATH_COLUMNS = ('file', 'path')  # Header names of a CSV list's column of paths.


def find_inputs(inputs: str) -> list[str]:
  """The files that `inputs` names: itself, the files under a directory, those a CSV file
  lists, or a glob's matches."""
  if os.path.isdir(inputs):
    return image_files.find_files(inputs)
  if os.path.isfile(inputs):
    return listed_files(inputs) if inputs.lower().endswith('.csv') else [inputs]
  return sorted(path for path in glob.glob(inputs, recursive=True) if os.path.isfile(path))


def listed_files(path: str) -> list[str]:
  """The image paths a CSV file lists, in its order: its column named file or path, else its
  first column; relative paths are relative to the CSV's directory. A `FlagError` for a CSV
  that cannot be read or lists no path."""
  def refuse(problem: str):
    return errors.FlagError(
        f'--inputs={path!r} {problem}: give a UTF-8 CSV file whose first column (or a column '
        f'named {" or ".join(_PATH_COLUMNS)}) lists image paths, relative to the CSV or '
        'absolute.', flag='inputs', value=path)
  try:
    with open(path, newline='', encoding='utf-8-sig') as file:
      rows = [[cell.strip() for cell in row] for row in csv.reader(file)
              if any(cell.strip() for cell in row)]
  except (OSError, UnicodeDecodeError, csv.Error) as error:
    raise refuse(f'is not a readable CSV file ({error})') from None
  if not rows:
    raise refuse('is empty')
  named = [k for k, cell in enumerate(rows[0]) if cell.lower() in _PATH_COLUMNS]
  column = named[0] if named else 0
  folder = os.path.dirname(path)
  # A header names its columns; a path has a file extension (or exists).
  first = rows[0][0]
  if named or ('.' not in first and not os.path.isfile(os.path.join(folder, first))):
    rows = rows[1:]
  entries = [row[column] if column < len(row) else '' for row in rows]
  if not entries or not all(entries):
    raise refuse(f'has a row without a path: {rows[entries.index("")]}' if entries
                 else 'lists no path')
  return [os.path.join(folder, entry) for entry in entries]  # An absolute entry stays itself.


@functools.partial(nnx.jit, static_argnums=1)
def probabilities(model: nnx.Module, preprocess: preprocessing.Preprocessing,
                   images: jax.Array) -> jax.Array:
  """The softmax of a uint8 batch, scaled by `preprocess` in the same program."""
  return jax.nn.softmax(model(preprocess.scale(images)).astype(jax.numpy.float32))


class _Progress:
  """A line every `every_seconds` while going through images: images done (`verb`: 'predicted'),
  images/s and an ETA, from the batches finished since the first (which includes the
  compilation)."""

  def __init__(self, total: int, every_seconds: float, verb: str):
    self._total, self._every, self._verb = total, every_seconds, verb
    self._rate = progress.Rate(0, total)
    self._last_report = None

  def update(self, done: int) -> None:
    measured = self._rate.update(done)
    now = time.monotonic()
    if measured is None:  # The first batch: the clock starts.
      self._last_report = now
      return
    if now - self._last_report < self._every or done >= self._total:
      return
    self._last_report = now
    rate, left = measured
    logging.info('%s %d/%d images (%.1f%%): %.1f images/s, ETA %s', self._verb, done, self._total,
                 100 * done / self._total, rate, progress.duration(left))


class Images(NamedTuple):
  """The images under `--inputs`: `batches` of {'path', 'image'} (uint8, the model's size),
  decoded and resized as eval's; `files`, the readable ones in order; `skipped`, the others."""
  batches: tf.data.Dataset
  files: list[str]
  skipped: list[str]


def read_images(run: run_spec.Run, info: base.DatasetInfo, inputs: str) -> Images:
  """The images under `inputs` (`cli.check_inputs`); a `FlagError` if there is no readable image
  under it, or colour images for a grayscale model."""
  headers, skipped = image_files.read_headers(find_inputs(inputs))
  if not headers:
    found = f' (only {len(skipped)} unreadable files)' if skipped else ''
    raise errors.FlagError(
        f'No image under --inputs={inputs!r}{found}: pass an image file, a directory of '
        f'{"/".join(image_files.FORMATS)} images or a glob that matches some.',
        flag='inputs', value=inputs)
  height, width, channels = info.image_shape
  colour = [header.path for header in headers if not header.gray]
  if channels == 1 and colour:
    named = ', '.join(colour[:_NAMED_FILES]) + (', ...' if len(colour) > _NAMED_FILES else '')
    raise errors.FlagError(
        f'--inputs has {len(colour)} colour images ({named}) but the model takes grayscale '
        'images: convert them to grayscale, or use a model trained on colour images.',
        flag='inputs', value=inputs)
  preprocess = run.input.preprocess

  def prepared(path, orientation, alpha) -> dict[str, tf.Tensor]:
    image = preprocess.resize(image_files.decode(path, channels, orientation, alpha),
                              (height, width))
    return {'path': path, 'image': tf.ensure_shape(image, info.image_shape)}

  # A file that passes the header check but fails to decode is dropped, not fatal: the paths
  # that come out say which (`_warn_unread`).
  batches = (tf.data.Dataset.from_tensor_slices((
      [header.path for header in headers], [header.orientation for header in headers],
      [header.alpha for header in headers]))
             .map(prepared, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
             .ignore_errors()
             .batch(run.eval_batch_size)
             .prefetch(1))
  return Images(batches, [header.path for header in headers], skipped)


def _warn_unread(images: Images, paths: list[str]) -> None:
  """One warning for the files of `images` that are not among the `paths` read."""
  read = set(paths)
  image_files.warn_skipped(images.skipped + [path for path in images.files if path not in read])


def compute(images: Images, batch_fn: Callable[[np.ndarray], jax.Array],
            verb: str) -> tuple[list[str], list[np.ndarray]]:
  """`batch_fn` of each batch of `images`, with a progress line (`verb`: 'predicted') and one
  warning for the files that did not decode: (the paths read, in order; the outputs by batch)."""
  paths, outputs = [], []
  shown = _Progress(len(images.files), PROGRESS_SECONDS, verb)
  for batch in images.batches.as_numpy_iterator():
    paths += [path.decode() for path in batch['path']]
    outputs.append(np.asarray(batch_fn(batch['image'])))
    shown.update(len(paths))
  _warn_unread(images, paths)
  return paths, outputs


def predict(run: run_spec.Run, workdir: str, inputs: str | None, checkpoint: str = 'latest',
            top_k: int = 1, tta: str | None = None) -> str:
  """Writes the `top_k` most probable classes of each image under `inputs` to
  <workdir>/predictions.csv, with test-time augmentation `tta` (config_values.TTA_CHOICES)."""
  cli.check_inputs(inputs, 'predict')
  info = modes.dataset_info(run, workdir)
  if not (isinstance(top_k, int) and 1 <= top_k <= info.num_classes):
    raise errors.FlagError(
        f'--top_k={top_k} is invalid: the model has {info.num_classes} classes, so give a '
        f'number in [1, {info.num_classes}].', flag='top_k', value=top_k)
  if tta not in (None, *config_values.TTA_CHOICES):
    raise errors.FlagError(f'--tta={tta!r} is invalid: use one of '
                           f'{config_values.TTA_CHOICES} or leave it unset.', flag='tta',
                           value=tta)
  model, step = modes.load_model(run, workdir, info, checkpoint)  # No checkpoint: said first.
  images = read_images(run, info, inputs)
  temperature = calibration.saved_temperature(workdir, run.temperature_scaling)
  model = calibration.scored(model, temperature, tta)
  logging.info('Predicting %d images with the checkpoint at step %d (temperature %.4f, '
               'test-time augmentation %s).', len(images.files), step, temperature,
               tta or 'none')
  paths, batches = compute(
      images, lambda batch: probabilities(model, run.input.preprocess, batch), 'predicted')
  image_probabilities = np.concatenate(batches) if batches else np.zeros((0, 1))
  # Most probable first; a stable sort keeps argmax's choice among ties as the first class.
  ranked = np.argsort(-image_probabilities, axis=1, kind='stable')[:, :top_k]
  rows = [(path, *((info.class_names[label], float(row[label])) for label in labels))
          for path, row, labels in zip(paths, image_probabilities, ranked)]
  header = ('file', 'class', 'probability') if top_k == 1 else (
      'file', *(f'{column}_{rank}' for rank in range(1, top_k + 1)
                for column in ('class', 'probability')))
  path = os.path.join(workdir, PREDICTIONS_FILE)
  os.makedirs(workdir, exist_ok=True)  # A workdir of init_from's weights, never trained in.
  with open(path, 'w', newline='', encoding='utf-8') as file:
    writer = csv.writer(file)
    writer.writerow(header)
    writer.writerows((file, *(value for name, probability in ranks
                              for value in (name, f'{probability:.6f}')))
                     for file, *ranks in rows)
  _print_table(header, rows, path)
  return path


def _print_table(header: tuple[str, ...], rows: list[tuple], path: str) -> None:
  shown = [(file, *(value for name, probability in ranks
                    for value in (name, f'{probability:.4f}')))
           for file, *ranks in rows[:_PRINTED_ROWS]]
  widths = [max([len(title), *(len(row[k]) for row in shown)]) for k, title in enumerate(header)]
  for row in (header, *shown):
    print('  '.join(f'{value:<{width}}' for value, width in zip(row, widths)).rstrip())
  more = f'{len(rows) - len(shown)} more; ' if len(rows) > len(shown) else ''
  print(f'({more}{len(rows)} predictions in {path})')
