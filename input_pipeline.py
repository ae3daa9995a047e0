"""Input pipeline: a split in memory (from any data source) as NumPy batches for JAX.

Each split is decoded once by its data source into NumPy arrays held in memory (MNIST-scale
data), then fed through tf.data in the order map (uint8 -> float32 in [0, 1]) -> shuffle ->
batch -> prefetch, or through a torch DataLoader (`config.input_backend='torch'`).
Training batches come stacked in chunks of `config.steps_per_dispatch` so that one jit call can
run several steps; every epoch has its own shuffle order derived from `config.seed`, so a run
can restart at any epoch and see the same data.
"""

from collections.abc import Iterator

import ml_collections
import numpy as np
import tensorflow as tf

from data_sources import base

Batch = dict[str, np.ndarray]
_MAP_BLOCK = 1024  # Examples normalised per tf.data map call.
_PREFETCH_CHUNKS = 2  # Training chunks prepared ahead of the train loop.


def _normalize(example: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
  example['image'] = tf.cast(example['image'], tf.float32) / 255.0
  return example


def epoch_seed(seed: int, epoch):
  """The shuffle seed of one epoch (an int or tf.int64 tensor): distinct per (seed, epoch)."""
  return seed * 2**20 + epoch  # Distinct for epochs below 2**20.


def train_batches(split: base.Split, config: ml_collections.ConfigDict,
                  start_epoch: int = 0, start_step: int = 0) -> Iterator[Batch]:
  """Yields chunks of training batches from batch `start_step` of `start_epoch` to the end.

  Each chunk is {'image': (K, B, H, W, C) float32, 'label': (K, B) int32} with K =
  `config.steps_per_dispatch`, except the last chunk of an epoch, which holds the remaining
  batches. An incomplete final batch of an epoch is dropped (static shapes). Every epoch is
  shuffled from its own seed (`epoch_seed`), so resuming at a `start_step` that is a multiple of
  K gives the same chunks as the uninterrupted run. `config.input_backend` chooses tf.data or a
  torch DataLoader.
  """
  if config.input_backend == 'torch':
    from data_sources import torch_loader  # pylint: disable=g-import-not-at-top  (optional)
    return torch_loader.dataloader_batches(split, config, start_epoch, start_step)
  return _tf_data_batches(split, config, start_epoch, start_step)


def _tf_data_batches(split: base.Split, config: ml_collections.ConfigDict, start_epoch: int,
                     start_step: int) -> Iterator[Batch]:
  # Normalised once, then kept in memory: later epochs only shuffle and batch. The map runs on
  # blocks of examples because a per-example map costs seconds per pass over MNIST.
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

  # tf.data's autotuning is off: with it on, reaching the end of the last epoch sometimes took
  # as long as the whole run had taken (about 1 run in 3 here, TF 2.21: a `main.py` that hung
  # after its last checkpoint). Two chunks ahead is all the train loop consumes.
  options = tf.data.Options()
  options.autotune.enabled = False
  epochs = tf.data.Dataset.range(start_epoch, config.num_epochs, output_type=tf.int64)
  yield from (epochs.flat_map(one_epoch).prefetch(_PREFETCH_CHUNKS).with_options(options)
              .as_numpy_iterator())


def eval_batches(split: base.Split, batch_size: int,
                 num_batches: int | None = None) -> list[Batch]:
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
