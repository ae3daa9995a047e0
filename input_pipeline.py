"""Input pipeline: a split, in memory or streamed from its files, as NumPy batches for JAX.

`open_split` gives a split as `config.in_memory` says: decoded once into NumPy arrays held in
memory (`base.Split`), or `Streamed`: read from the source's files on every pass (TFDS files or
image folders), decoded in parallel, never whole in memory. Either way, images are resized to
`config.image_size` where they are decoded and stay uint8 until batched.

Training examples go through tf.data as map (decode and resize, once for a split in memory,
on every pass when streamed) -> shuffle -> batch -> prefetch, where each batch is also mapped
from uint8 to float32 in [0, 1] and `config.augment`ed as it is made (vectorised over the batch,
and the shuffle buffer holds uint8: a quarter of the memory), or through a torch DataLoader
(`config.input_backend='torch'`, in memory only). They come stacked in chunks of
`config.steps_per_dispatch` so that one jit call can run several steps. Every epoch has its own
shuffle order (and file order, when streamed) and augmentation draws, derived from
`config.seed`, so a run can restart at any step and see the same data.
"""

from collections.abc import Callable, Iterator
import dataclasses
import math
import os

from absl import logging
import ml_collections
import numpy as np
import tensorflow as tf

import data_sources
from data_sources import augmentations
from data_sources import base

Batch = dict[str, np.ndarray]
IN_MEMORY = ('auto', 'always', 'never')
# in_memory='auto' keeps a split in memory when 4 bytes per pixel (the float32 copy of a batch
# on its way to the devices, as the eval batches are kept) fit in this share of physical memory.
MEMORY_SHARE = 0.25
_MAP_BLOCK = 1024  # Examples resized or normalised per tf.data map call.
_PREFETCH_CHUNKS = 2  # Training chunks prepared ahead of the train loop.
_PREFETCH_EVAL = 2  # Streamed eval batches read ahead.


@dataclasses.dataclass(frozen=True)
class Streamed:
  """A split read from its source's files on every pass; only tf.data's buffers are in memory."""
  # shuffle seed (None: the source's order) -> {'image': uint8 image_shape, 'label': int32}.
  examples: Callable[[int | None], tf.data.Dataset]
  num_examples: int
  image_shape: tuple[int, int, int]


def _normalize(example: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
  example['image'] = tf.cast(example['image'], tf.float32) / 255.0
  return example


def resize(images: tf.Tensor, size: tuple[int, int]) -> tf.Tensor:
  """uint8 images (..., height, width, channels) resized to `size` (height, width), as uint8.

  Antialiased bilinear, so shrinking does not alias; rounded back to uint8, so a resized split
  takes no more memory than the source's, and in-memory, streamed and predicted pixels agree.
  """
  if tuple(images.shape[-3:-1]) == tuple(size):
    return images
  resized = tf.image.resize(images, size, antialias=True)
  return tf.cast(tf.clip_by_value(tf.round(resized), 0, 255), tf.uint8)


def epoch_seed(seed: int, epoch):
  """The shuffle seed of one epoch (an int or tf.int64 tensor): distinct per (seed, epoch)."""
  return seed * 2**20 + epoch  # Distinct for epochs below 2**20.


def open_split(source: base.DataSource, split: base.SplitArg,
               config: ml_collections.ConfigDict) -> base.Split | Streamed:
  """`split` of `source` with its images resized to `config.image_size`, in memory or streamed.

  `config.in_memory`: 'always' decodes the split into memory, 'never' streams it, and 'auto'
  keeps it in memory when it fits `MEMORY_SHARE` of the machine's memory (sources that cannot
  stream always load into memory).
  """
  height, width, channels = source.image_shape
  size = (config.image_size,) * 2 if config.image_size else (height, width)
  image_shape = (*size, channels)
  num_examples = source.num_examples(split)

  def resized(examples: tf.data.Dataset) -> tf.data.Dataset:
    return examples.map(
        lambda example: {'image': tf.ensure_shape(resize(example['image'], size), image_shape),
                         'label': example['label']},
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

  if not _in_memory(config, split, num_examples, image_shape):
    logging.info('Streaming split %r of %s (%d examples) from its files.', split, source.name,
                 num_examples)
    return Streamed(lambda seed: resized(source.examples(split, seed)), num_examples, image_shape)
  if height is None or width is None:  # Images of varying sizes: resized as they are decoded.
    return base.materialize(resized(source.examples(split)))
  loaded = source.load_split(split)
  if (height, width) == size:
    return loaded
  images = (tf.data.Dataset.from_tensor_slices(loaded.images).batch(_MAP_BLOCK)
            .map(lambda images: resize(images, size)).as_numpy_iterator())
  return base.Split(images=np.concatenate(list(images)), labels=loaded.labels)


def _in_memory(config: ml_collections.ConfigDict, split: base.SplitArg, num_examples: int,
               image_shape: tuple[int, int, int]) -> bool:
  if (config.in_memory != 'auto' or config.input_backend == 'torch'
      or config.data_source not in data_sources.STREAMING_SOURCES):
    return config.in_memory != 'never'
  size = num_examples * math.prod(image_shape) * 4
  budget = MEMORY_SHARE * os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  logging.info("in_memory='auto': split %r takes %.0f MB as float32, %s %.0f MB (%.0f%% of "
               'memory): %s.', split, size / 2**20, 'within' if size <= budget else 'over',
               budget / 2**20, MEMORY_SHARE * 100,
               'in memory' if size <= budget else 'streamed from its files')
  return size <= budget


def train_batches(split: base.Split | Streamed, config: ml_collections.ConfigDict,
                  start_epoch: int = 0, start_step: int = 0) -> Iterator[Batch]:
  """Yields chunks of training batches from batch `start_step` of `start_epoch` to the end.

  Each chunk is {'image': (K, B, H, W, C) float32, 'label': (K, B) int32} with K =
  `config.steps_per_dispatch`, except the last chunk of an epoch, which holds the remaining
  batches. An incomplete final batch of an epoch is dropped (static shapes). Every epoch is
  shuffled and augmented from its own seed (`epoch_seed`), so resuming at a `start_step` that is
  a multiple of K gives the same chunks as the uninterrupted run. `config.input_backend` chooses
  tf.data or a torch DataLoader.
  """
  if config.input_backend == 'torch':
    from data_sources import torch_loader  # pylint: disable=g-import-not-at-top  (optional)
    return torch_loader.dataloader_batches(split, config, start_epoch, start_step)
  if isinstance(split, Streamed):
    return _streamed_batches(split, config, start_epoch, start_step)
  return _in_memory_batches(split, config, start_epoch, start_step)


def _in_memory_batches(split: base.Split, config: ml_collections.ConfigDict, start_epoch: int,
                       start_step: int) -> Iterator[Batch]:
  examples = tf.data.Dataset.from_tensor_slices({'image': split.images, 'label': split.labels})

  def one_epoch(epoch: tf.Tensor) -> tf.data.Dataset:
    return _epoch_chunks(examples.shuffle(config.shuffle_buffer_size,
                                          seed=epoch_seed(config.seed, epoch),
                                          reshuffle_each_iteration=False),
                         config, epoch, start_epoch, start_step)

  epochs = tf.data.Dataset.range(start_epoch, config.num_epochs, output_type=tf.int64)
  yield from _numpy_chunks(epochs.flat_map(one_epoch))


def _streamed_batches(split: Streamed, config: ml_collections.ConfigDict, start_epoch: int,
                      start_step: int) -> Iterator[Batch]:
  # One pipeline per epoch: each epoch's file order is a Python-level argument of the reader.
  # The shuffle buffer holds config.shuffle_buffer_size decoded uint8 examples: the memory that
  # streaming needs, whatever the split's size.
  for epoch in range(start_epoch, config.num_epochs):
    seed = epoch_seed(config.seed, epoch)
    examples = split.examples(seed).shuffle(config.shuffle_buffer_size, seed=seed)
    yield from _numpy_chunks(_epoch_chunks(examples, config, epoch, start_epoch, start_step))


def _epoch_chunks(examples: tf.data.Dataset, config: ml_collections.ConfigDict, epoch,
                  start_epoch: int, start_step: int) -> tf.data.Dataset:
  """One epoch of shuffled uint8 examples as chunks of normalised, augmented batches.

  Batches are numbered before the ones already trained on are skipped, so each batch's
  augmentation seed (config.seed, epoch, batch number) is the same in a resumed run.
  """
  ops = augmentations.parse(config.augment)

  def prepare(index: tf.Tensor, batch: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    batch = _normalize(batch)
    if ops:
      seed = tf.stack([tf.cast(epoch_seed(config.seed, epoch), tf.int64), index])
      batch['image'] = augmentations.apply(ops, batch['image'], seed)
    return batch

  return (examples.batch(config.batch_size, drop_remainder=True)
          .enumerate()
          .skip(tf.cast(epoch == start_epoch, tf.int64) * start_step)  # Already trained on.
          .map(prepare)
          .batch(config.steps_per_dispatch))


def _numpy_chunks(chunks: tf.data.Dataset) -> Iterator[Batch]:
  # tf.data's autotuning is off: with it on, reaching the end of the last epoch sometimes took
  # as long as the whole run had taken (about 1 run in 3 here, TF 2.21: a `main.py` that hung
  # after its last checkpoint). Two chunks ahead is all the train loop consumes.
  options = tf.data.Options()
  options.autotune.enabled = False
  yield from chunks.prefetch(_PREFETCH_CHUNKS).with_options(options).as_numpy_iterator()


def eval_batches(split: base.Split | Streamed, batch_size: int, num_batches: int | None = None,
                 place: Callable[[Batch], Batch] = lambda batch: batch,
                 ) -> 'list[Batch] | StreamedBatches':
  """The whole split as equal-sized batches, each example exactly once.

  The last batch is padded with zero images; `mask` is 1 for real examples and 0 for padding,
  so every batch has one compiled shape and padding never counts. `num_batches` pads further,
  to that many batches (so that every process runs the same number of eval steps). `place`
  puts each batch where it is used (e.g. sharded on the devices). An in-memory split gives a
  list; a streamed one gives `StreamedBatches`, which reads the split again on every pass.
  """
  num_examples = split.num_examples if isinstance(split, Streamed) else len(split.labels)
  pad = -num_examples % batch_size
  if num_batches is not None:
    pad = num_batches * batch_size - num_examples
  if isinstance(split, Streamed):
    return StreamedBatches(split, batch_size, pad, place)
  mask = np.concatenate([np.ones(num_examples, np.bool_), np.zeros(pad, np.bool_)])
  images = np.concatenate([split.images, np.zeros((pad, *split.images.shape[1:]), np.uint8)])
  labels = np.concatenate([split.labels, np.zeros(pad, np.int32)])
  dataset = (tf.data.Dataset.from_tensor_slices({'image': images, 'label': labels, 'mask': mask})
             .batch(batch_size)
             .map(_normalize)
             .prefetch(tf.data.AUTOTUNE))
  return [place(batch) for batch in dataset.as_numpy_iterator()]


class StreamedBatches:
  """The eval batches of a streamed split: an iterable that reads the split on every pass."""

  def __init__(self, split: Streamed, batch_size: int, pad: int,
               place: Callable[[Batch], Batch]):
    self._split, self._batch_size, self._pad, self._place = split, batch_size, pad, place

  def _batches(self, keys: tuple[str, ...]) -> Iterator[Batch]:
    real = self._split.examples(None).map(lambda example: {**example, 'mask': True})
    padding = tf.data.Dataset.from_tensors({
        'image': tf.zeros(self._split.image_shape, tf.uint8), 'label': tf.constant(0, tf.int32),
        'mask': tf.constant(False)}).repeat(self._pad)
    batches = (real.concatenate(padding).batch(self._batch_size).map(_normalize)
               .prefetch(_PREFETCH_EVAL))
    for batch in batches.as_numpy_iterator():
      yield self._place({key: batch[key] for key in keys})

  def __iter__(self) -> Iterator[Batch]:
    return self._batches(('image', 'label', 'mask'))

  def real_examples(self, to_host: Callable) -> tuple['StreamedImages', np.ndarray]:
    """(images, labels) of the real examples in order, as `summaries.real_examples` gives.

    Only the labels are kept; the images are read again, when indexed, by `StreamedImages`.
    `to_host` gathers a placed array onto the host.
    """
    labels = np.concatenate([to_host(batch['label'])[to_host(batch['mask'])]
                             for batch in self._batches(('label', 'mask'))])
    return StreamedImages(self, to_host), labels


class StreamedImages:
  """The eval images of a streamed split, read from its files when indexed with an index array."""

  def __init__(self, batches: StreamedBatches, to_host: Callable):
    self._batches, self._to_host = batches, to_host

  def __getitem__(self, indices: np.ndarray) -> np.ndarray:
    wanted = {int(index): None for index in indices}
    offset = 0
    for batch in self._batches:
      images = self._to_host(batch['image'])[self._to_host(batch['mask'])]
      for index in range(offset, offset + len(images)):
        if index in wanted:
          wanted[index] = images[index - offset]
      offset += len(images)
      if all(image is not None for image in wanted.values()):
        break  # Every process sees the same gathered batches, so all stop here together.
    return np.stack([wanted[int(index)] for index in indices])
