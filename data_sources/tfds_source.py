"""TFDS datasets: prepared (offline from the manual-download dir if need be) and decoded fast."""

import functools
import os
import socket
import urllib.parse

from absl import logging
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from core import errors
import data_sources
from data_sources import base

_DECODE_BLOCK = 100  # Images decoded per tf.data map call (one graph of this many decode ops).


@data_sources.SOURCES.register('tfds', can_stream=True)
class TfdsSource(base.DataSource):
  """A TFDS image-classification dataset with 'image' and 'label' features.

  `name` is a registered TFDS name ('mnist', 'cifar10', ...) or the name of a dataset prepared
  in `data_dir` (default: $TFDS_DATA_DIR or ~/tensorflow_datasets).
  """

  def __init__(self, name: str, data_dir: str | None):
    super().__init__(name)
    self.builder = prepared_builder(name, data_dir)
    features = self.builder.info.features
    if 'image' not in features or 'label' not in features:
      raise errors.DataError(f'Dataset {name!r} has features {sorted(features)}; an image '
                             "classification dataset with 'image' and 'label' features is "
                             'needed.', what=name)

  @property
  def image_shape(self) -> tuple[int, int, int]:
    return tuple(self.builder.info.features['image'].shape)

  @property
  def num_classes(self) -> int:
    return self.builder.info.features['label'].num_classes

  @property
  def class_names(self) -> tuple[str, ...]:
    return tuple(self.builder.info.features['label'].names)

  def num_examples(self, split: str) -> int:
    return self.builder.info.splits[split].num_examples

  def load_split(self, split: tfds.typing.SplitArg) -> base.Split:
    """Decodes a whole split into memory: file by file, in each file's order (TFDS's order).

    TFDS's reader parses and decodes one example per tf.data call, mostly per-call overhead.
    TFRecord files are read here instead in blocks of `_DECODE_BLOCK` examples, parsed together
    and decoded by one graph per block; other file formats go through TFDS's reader.
    """
    builder = self.builder
    if builder.info.file_format != tfds.core.FileFormat.TFRECORD:
      data = tfds.as_numpy(builder.as_dataset(split=split, batch_size=-1, shuffle_files=False))
      return base.Split(images=data['image'], labels=data['label'].astype(np.int32))
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
        return (tf.stack([decode_image(example['image'][i]) for i in range(size)]),
                example['label'])
      return decode

    remainder = split_info.num_examples % _DECODE_BLOCK
    in_blocks = split_info.num_examples - remainder
    blocks = (records.take(in_blocks).batch(_DECODE_BLOCK, drop_remainder=True)
              .map(decode_block(_DECODE_BLOCK)))
    if remainder:  # The last examples, as one smaller block.
      blocks = blocks.concatenate(
          records.skip(in_blocks).batch(remainder).map(decode_block(remainder)))
    images, labels = zip(*blocks.as_numpy_iterator())
    return base.Split(images=np.concatenate(images),
                      labels=np.concatenate(labels).astype(np.int32))

  def examples(self, split: base.SplitArg, shuffle_seed: int | None = None) -> tf.data.Dataset:
    """TFDS's reader: files interleaved (in an order drawn from `shuffle_seed`), parallel decode."""
    # No autocache: TFDS would otherwise keep a small split in memory after its first pass.
    read_config = tfds.ReadConfig(shuffle_seed=shuffle_seed, try_autocache=False)
    dataset = self.builder.as_dataset(split=split, shuffle_files=shuffle_seed is not None,
                                      read_config=read_config)
    return dataset.map(lambda example: {'image': example['image'],
                                        'label': tf.cast(example['label'], tf.int32)})


def prepared_builder(name: str, data_dir: str | None) -> tfds.core.DatasetBuilder:
  """Returns the TFDS builder of `name`, downloading and preparing it if needed.

  Offline, TFDS takes the original files from `<data_dir>/downloads/manual/`. When the data is
  neither prepared, nor there, nor downloadable, raises an error that says which files to put
  where, instead of retrying downloads for minutes.
  """
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError as error:
    raise errors.ConfigError(
        f'Unknown dataset {name!r}: config.dataset must be a TFDS dataset name such as '
        "'mnist', 'fashion_mnist', 'kmnist' or 'cifar10' (see tfds.list_builders()), or the name "
        'of a dataset prepared in config.data_dir (now '
        f'{data_dir or "TFDS default: $TFDS_DATA_DIR or ~/tensorflow_datasets"}).',
        key='dataset', value=name) from error
  if builder.is_prepared():
    return builder
  manual_dir = os.path.join(builder.data_dir_root, 'downloads', 'manual')
  files = sorted(info.filename or os.path.basename(url)
                 for url, info in (builder.url_infos or {}).items())
  missing = [file for file in files if not os.path.exists(os.path.join(manual_dir, file))]
  hosts = {urllib.parse.urlparse(url).hostname for url in (builder.url_infos or {})}
  if missing and not all(_reachable(host) for host in hosts):
    raise errors.DataError(_missing_data_message(name, manual_dir, missing), what=manual_dir)
  logging.info('Preparing %s in %s (manual dir %s).', name, builder.data_dir_root, manual_dir)
  try:
    builder.download_and_prepare()
  except Exception as error:  # TFDS raises many types; all mean the same thing to the user.
    raise errors.DataError(f'{_missing_data_message(name, manual_dir, files)} (TFDS said: '
                           f'{error})', what=manual_dir) from error
  return builder


def _reachable(host: str, timeout: float = 3.0) -> bool:
  try:
    socket.create_connection((host, 443), timeout=timeout).close()
    return True
  except OSError:
    return False


def _missing_data_message(name: str, manual_dir: str, files: list[str]) -> str:
  wanted = ', '.join(files) if files else "the dataset's original files"
  return (f'TFDS dataset {name!r} is not prepared and could not be downloaded. To prepare it '
          f'offline, put {wanted} in {manual_dir}/, or set config.data_dir (or $TFDS_DATA_DIR) '
          'to a directory where it is already prepared.')
