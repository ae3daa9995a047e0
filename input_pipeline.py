"""Input pipeline: a TFDS image-classification dataset as NumPy batches.

Each split is decoded once into NumPy arrays held in memory (MNIST-scale data), then fed through
tf.data in the order map (uint8 -> float32 in [0, 1]) -> shuffle -> batch -> prefetch.
Training batches come stacked in chunks of `config.steps_per_dispatch` so that one jit call can
run several steps; every epoch has its own shuffle order derived from `config.seed`, so a run
can restart at any epoch and see the same data.
"""

import dataclasses
import functools
import os
import socket
from collections.abc import Iterator
import urllib.parse

from absl import logging
import ml_collections
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

Batch = dict[str, np.ndarray]
_MAP_BLOCK = 1024  # Examples normalised per tf.data map call.
_DECODE_BLOCK = 100  # Images decoded per tf.data map call (one graph of this many decode ops).


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """What the model and the train loop need to know about the data."""
  name: str
  image_shape: tuple[int, int, int]  # (height, width, channels).
  num_classes: int
  num_train_examples: int
  num_eval_examples: int


@dataclasses.dataclass(frozen=True)
class Split:
  """A whole split in memory: uint8 images (N, H, W, C) and int32 labels (N,)."""
  images: np.ndarray
  labels: np.ndarray


def prepared_builder(config: ml_collections.ConfigDict) -> tfds.core.DatasetBuilder:
  """Returns the TFDS builder for `config.dataset`, downloading and preparing it if needed.

  Offline, TFDS takes the original files from `<data_dir>/downloads/manual/`. When the data is
  neither prepared, nor there, nor downloadable, raises an error that says which files to put
  where, instead of retrying downloads for minutes.
  """
  builder = tfds.builder(config.dataset, data_dir=config.data_dir)
  if builder.is_prepared():
    return builder
  manual_dir = os.path.join(builder.data_dir_root, 'downloads', 'manual')
  files = sorted(info.filename or os.path.basename(url)
                 for url, info in (builder.url_infos or {}).items())
  missing = [name for name in files if not os.path.exists(os.path.join(manual_dir, name))]
  hosts = {urllib.parse.urlparse(url).hostname for url in (builder.url_infos or {})}
  if missing and not all(_reachable(host) for host in hosts):
    raise RuntimeError(_missing_data_message(config.dataset, manual_dir, missing))
  logging.info('Preparing %s in %s (manual dir %s).', config.dataset, builder.data_dir_root,
               manual_dir)
  try:
    builder.download_and_prepare()
  except Exception as error:  # TFDS raises many types; all mean the same thing to the user.
    raise RuntimeError(
        f'{_missing_data_message(config.dataset, manual_dir, files)}\n(TFDS said: {error})'
    ) from error
  return builder


def _reachable(host: str, timeout: float = 3.0) -> bool:
  try:
    socket.create_connection((host, 443), timeout=timeout).close()
    return True
  except OSError:
    return False


def _missing_data_message(dataset: str, manual_dir: str, files: list[str]) -> str:
  wanted = ', '.join(files) if files else "the dataset's original files"
  return (f'TFDS dataset {dataset!r} is not prepared and could not be downloaded. To prepare it '
          f'offline, put {wanted} in {manual_dir} (for MNIST: cp ../shared/datasets/mnist/*.gz '
          f'{manual_dir}/), or set config.data_dir / $TFDS_DATA_DIR to a directory where it is '
          'already prepared.')


def get_info(builder: tfds.core.DatasetBuilder, config: ml_collections.ConfigDict) -> DatasetInfo:
  """Reads image shape, class count and split sizes from the builder's metadata."""
  features = builder.info.features
  if 'image' not in features or 'label' not in features:
    raise ValueError(f'Dataset {config.dataset!r} has features {sorted(features)}; an image '
                     "classification dataset with 'image' and 'label' features is needed.")
  splits = builder.info.splits
  return DatasetInfo(
      name=config.dataset,
      image_shape=tuple(features['image'].shape),
      num_classes=features['label'].num_classes,
      num_train_examples=splits[config.train_split].num_examples,
      num_eval_examples=splits[config.eval_split].num_examples,
  )


def load_split(builder: tfds.core.DatasetBuilder, split: tfds.typing.SplitArg) -> Split:
  """Decodes a whole split into memory: file by file, in each file's order (TFDS's order).

  TFDS's reader parses and decodes one example per tf.data call (5.6 s for MNIST's training
  split on 2 cores, mostly per-call overhead). TFRecord files are read here instead in blocks of
  `_DECODE_BLOCK` examples, parsed together and decoded by one graph per block (2.0 s); other
  file formats go through TFDS's reader.
  """
  if builder.info.file_format != tfds.core.FileFormat.TFRECORD:
    data = tfds.as_numpy(builder.as_dataset(split=split, batch_size=-1, shuffle_files=False))
    return Split(images=data['image'], labels=data['label'].astype(np.int32))
  split_info = builder.info.splits[split]
  records = functools.reduce(tf.data.Dataset.concatenate, [
      tf.data.TFRecordDataset(file.filename).skip(file.skip).take(file.take)
      for file in split_info.file_instructions])
  decode_image = builder.info.features['image'].decode_example
  features = {'image': tf.io.FixedLenFeature([], tf.string),
              'label': tf.io.FixedLenFeature([], tf.int64)}

  def decode_block(size: int):
    def decode(serialized: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
      example = tf.io.parse_example(serialized, features)
      return tf.stack([decode_image(example['image'][i]) for i in range(size)]), example['label']
    return decode

  remainder = split_info.num_examples % _DECODE_BLOCK
  in_blocks = split_info.num_examples - remainder
  blocks = (records.take(in_blocks).batch(_DECODE_BLOCK, drop_remainder=True)
            .map(decode_block(_DECODE_BLOCK)))
  if remainder:  # The last examples, as one smaller block.
    blocks = blocks.concatenate(
        records.skip(in_blocks).batch(remainder).map(decode_block(remainder)))
  images, labels = zip(*blocks.as_numpy_iterator())
  return Split(images=np.concatenate(images), labels=np.concatenate(labels).astype(np.int32))


def _normalize(example: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
  example['image'] = tf.cast(example['image'], tf.float32) / 255.0
  return example


def epoch_seed(seed: int, epoch):
  """The shuffle seed of one epoch (an int or tf.int64 tensor): distinct per (seed, epoch)."""
  return seed * 2**20 + epoch  # Distinct for epochs below 2**20.


def train_batches(split: Split, config: ml_collections.ConfigDict,
                  start_epoch: int = 0, start_step: int = 0) -> Iterator[Batch]:
  """Yields chunks of training batches from batch `start_step` of `start_epoch` to the end.

  Each chunk is {'image': (K, B, H, W, C) float32, 'label': (K, B) int32} with K =
  `config.steps_per_dispatch`, except the last chunk of an epoch, which holds the remaining
  batches. An incomplete final batch of an epoch is dropped (static shapes). Resuming at a
  `start_step` that is a multiple of K gives the same chunks as the uninterrupted run.
  """
  # Normalised once, then kept in memory: later epochs only shuffle and batch. The map runs on
  # blocks of examples because a per-example map costs ~5 s per pass over MNIST on 2 cores.
  examples = (tf.data.Dataset.from_tensor_slices({'image': split.images, 'label': split.labels})
              .batch(_MAP_BLOCK)
              .map(_normalize)
              .unbatch()
              .cache())

  def one_epoch(epoch: tf.Tensor) -> tf.data.Dataset:
    return (examples
            .shuffle(config.shuffle_buffer_size, seed=epoch_seed(config.seed, epoch),
                     reshuffle_each_iteration=False)
            .batch(config.batch_size, drop_remainder=True)
            .skip(tf.cast(epoch == start_epoch, tf.int64) * start_step)  # Already trained on.
            .batch(config.steps_per_dispatch))

  epochs = tf.data.Dataset.range(start_epoch, config.num_epochs, output_type=tf.int64)
  yield from epochs.flat_map(one_epoch).prefetch(tf.data.AUTOTUNE).as_numpy_iterator()


def eval_batches(split: Split, batch_size: int, num_batches: int | None = None) -> list[Batch]:
  """The whole split as equal-sized batches, each example exactly once.

  The last batch is padded with zero images; `mask` is 1 for real examples and 0 for padding,
  so every batch has one compiled shape and padding never counts. `num_batches` pads further,
  to that many batches (so that every process runs the same number of eval steps).
  """
  num_examples = len(split.labels)
  pad = -num_examples % batch_size
  if num_batches is not None:
    pad = num_batches * batch_size - num_examples
  mask = np.concatenate([np.ones(num_examples, np.bool_), np.zeros(pad, np.bool_)])
  images = np.concatenate([split.images, np.zeros((pad, *split.images.shape[1:]), np.uint8)])
  labels = np.concatenate([split.labels, np.zeros(pad, np.int32)])
  dataset = (tf.data.Dataset.from_tensor_slices({'image': images, 'label': labels, 'mask': mask})
             .batch(batch_size)
             .map(_normalize)
             .prefetch(tf.data.AUTOTUNE))
  return list(dataset.as_numpy_iterator())
