"""Input pipeline: a data source's splits, preprocessed, as NumPy batches for JAX.

`open_data` opens `config.data_source`, parses `config.preprocess` and checks the splits: the
`DatasetInfo` the model is built for. `open_split` gives a split as `config.in_memory` says:
decoded once into NumPy arrays held in memory (`base.Split`), or `Streamed`: read from the
source's files on every pass, decoded in parallel, never whole in memory. Either way, images are
resized (the preprocessing's first stage) where they are decoded and stay uint8 until batched.

Training examples go through tf.data as map (decode and resize, once for a split in memory, on
every pass when streamed) -> shuffle -> batch -> prefetch, where each batch is also mapped, as
it is made, through the preprocessing's random ops and scaling (vectorised over the batch; the
shuffle buffer holds uint8, a quarter of the memory). With `config.input_backend='torch'` a
torch DataLoader shuffles and batches instead, and tf.data maps its batches the same way. Every
epoch has its own shuffle order (and file order, when streamed) and augmentation draws, derived
from `config.seed`, so a run can restart at any step and see the same data. Eval batches get
the deterministic stages only, padded to equal sizes with a mask.
"""

from collections.abc import Callable, Iterator
import dataclasses
import functools
import math
import os

from absl import logging
import ml_collections
import numpy as np
import tensorflow as tf

from core import errors
import data_sources
from data_sources import base
import preprocessing
from preprocessing import mix

Batch = dict[str, np.ndarray]
IN_MEMORY = ('auto', 'always', 'never')
INPUT_BACKENDS = ('tf', 'torch')
# in_memory='auto' keeps a split in memory when 4 bytes per pixel (the float32 copy of a batch
# on its way to the devices, as the eval batches are kept) fit in this share of physical memory.
MEMORY_SHARE = 0.25
_MAP_BLOCK = 1024  # Examples resized per tf.data map call.
_PREFETCH_BATCHES = 2  # Training batches prepared ahead of the train loop.
_PREFETCH_EVAL = 2  # Streamed eval batches read ahead.
_FEW_EXAMPLES = 10  # A class with fewer training examples than this gets a warning.


@dataclasses.dataclass(frozen=True)
class Data:
  """A data source with its preprocessing, and the metadata of the config's splits."""
  source: base.DataSource
  preprocess: preprocessing.Preprocessing
  info: base.DatasetInfo


@dataclasses.dataclass(frozen=True)
class Streamed:
  """A split read from its source's files on every pass; only tf.data's buffers are in memory."""
  # shuffle seed (None: the source's order) -> {'image': uint8 image_shape, 'label': int32}.
  examples: Callable[[int | None], tf.data.Dataset]
  num_examples: int
  image_shape: tuple[int, int, int]


def open_data(config: ml_collections.ConfigDict) -> Data:
  """`config.data_source` with `config.preprocess`; the splits checked, nothing decoded."""
  check_input(config)
  preprocess = preprocessing.parse(config.preprocess)
  source = data_sources.open_source(config)
  sizes = {key: source.split_size(key, config[key]) if config.get(key) else 0
           for key in ('train_split', 'eval_split', 'test_split')}
  info = base.DatasetInfo(
      name=source.name, image_shape=preprocess.image_shape(source.image_shape, source.name),
      num_classes=source.num_classes, num_train_examples=sizes['train_split'],
      num_eval_examples=sizes['eval_split'], num_test_examples=sizes['test_split'],
      class_names=tuple(source.class_names))
  return Data(source, preprocess, info)


def can_stream(config: ml_collections.ConfigDict) -> bool:
  return bool(data_sources.SOURCES.capability(config.data_source, 'can_stream'))


def check_input(config: ml_collections.ConfigDict) -> None:
  """Checks that the data source and input backend can serve config.in_memory and the random
  ops of config.preprocess."""
  if config.in_memory == 'never' and not can_stream(config):
    streaming = [name for name in data_sources.SOURCES.names()
                 if data_sources.SOURCES.capability(name, 'can_stream')]
    raise errors.ConfigError(
        f"config.in_memory='never' streams splits from their files, which data_source "
        f"{config.data_source!r} cannot: use in_memory='auto' or 'always', or a data source "
        f'that streams ({", ".join(streaming)}).', key='in_memory', value='never')
  if config.input_backend == 'torch':
    try:
      import torch  # pylint: disable=g-import-not-at-top,unused-import  (optional)
    except ImportError as error:
      raise errors.MissingPackage(
          "config.input_backend='torch' needs the 'torch' package, which is not installed: pip "
          'install -r requirements-extras.txt (or pip install torch).', key='input_backend',
          value='torch', package='torch') from error
  if config.input_backend == 'torch' and (config.in_memory == 'never'
                                          or preprocessing.parse(config.preprocess).random_ops):
    raise errors.ConfigError(
        "config.input_backend='torch' takes in-memory splits without random ops: use "
        "input_backend='tf' for in_memory='never' or random ops in config.preprocess.",
        key='input_backend', value=config.input_backend)


def mixes(config: ml_collections.ConfigDict) -> bool:
  """Whether training batches are mixed (Mixup or CutMix), with soft targets."""
  return bool(config.mixup_alpha or config.cutmix_alpha)


def epoch_seed(seed: int, epoch):
  """The shuffle seed of one epoch (an int or tf.int64 tensor): distinct per (seed, epoch)."""
  return seed * 2**20 + epoch  # Distinct for epochs below 2**20.


def open_split(data: Data, split: base.SplitArg,
               config: ml_collections.ConfigDict) -> base.Split | Streamed:
  """`split` of the source with its images resized, in memory or streamed.

  `config.in_memory`: 'always' decodes the split into memory, 'never' streams it, and 'auto'
  keeps it in memory when it fits `MEMORY_SHARE` of the machine's memory (sources that cannot
  stream always load into memory).
  """
  source, image_shape = data.source, data.info.image_shape
  num_examples = source.num_examples(split)

  def resized(examples: tf.data.Dataset) -> tf.data.Dataset:
    return examples.map(
        lambda example: {
            'image': tf.ensure_shape(data.preprocess.resize(example['image']), image_shape),
            'label': example['label']},
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

  if not _in_memory(config, split, num_examples, image_shape):
    logging.info('Streaming split %r of %s (%d examples) from its files.', split, source.name,
                 num_examples)
    return Streamed(lambda seed: resized(source.examples(split, seed)), num_examples, image_shape)
  if None in source.image_shape[:2]:  # Images of varying sizes: resized as they are decoded.
    return base.materialize(resized(source.examples(split)))
  loaded = source.load_split(split)
  if loaded.images.shape[1:] == image_shape:
    return loaded
  images = (tf.data.Dataset.from_tensor_slices(loaded.images).batch(_MAP_BLOCK)
            .map(data.preprocess.resize).as_numpy_iterator())
  return base.Split(images=np.concatenate(list(images)), labels=loaded.labels)


def _in_memory(config: ml_collections.ConfigDict, split: base.SplitArg, num_examples: int,
               image_shape: tuple[int, int, int]) -> bool:
  if config.in_memory != 'auto' or not can_stream(config) or config.input_backend == 'torch':
    return config.in_memory != 'never'
  size = num_examples * math.prod(image_shape) * 4
  budget = MEMORY_SHARE * os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  logging.info("in_memory='auto': split %r takes %.0f MB as float32, %s %.0f MB (%.0f%% of "
               'memory): %s.', split, size / 2**20, 'within' if size <= budget else 'over',
               budget / 2**20, MEMORY_SHARE * 100,
               'in memory' if size <= budget else 'streamed from its files')
  return size <= budget


def log_class_counts(labels: np.ndarray, class_names: tuple[str, ...], split: str) -> None:
  """Logs how many examples of each class `split` has; warns about missing and rare classes."""
  counts = np.bincount(labels, minlength=len(class_names))
  logging.info('Examples per class in %r: %s.', split, ', '.join(
      f'{name} {count}' for name, count in zip(class_names, counts)))
  if missing := [name for name, count in zip(class_names, counts) if not count]:
    logging.warning('Split %r has no example of the classes %s: the model cannot learn them.',
                    split, ', '.join(missing))
  if rare := [f'{name} ({count})' for name, count in zip(class_names, counts)
              if 0 < count < _FEW_EXAMPLES]:
    logging.warning('Split %r has fewer than %d examples of the classes %s: expect poor '
                    'accuracy on them.', split, _FEW_EXAMPLES, ', '.join(rare))


def train_batches(split: base.Split | Streamed, data: Data, config: ml_collections.ConfigDict,
                  batch_size: int, start_epoch: int = 0, start_step: int = 0,
                  augment: bool = True) -> Iterator[Batch]:
  """Yields training batches from batch `start_step` of `start_epoch` to the end of the run.

  Each batch is {'image': (batch_size, H, W, C) float32, 'label': (batch_size,) int32},
  preprocessed for training, and with Mixup or CutMix 'target': (batch_size, classes) float32
  soft targets; an incomplete final batch of an epoch is dropped (static shapes).
  Every epoch is shuffled and augmented from its own seed (`epoch_seed`), so resuming at any
  step gives the same batches as the uninterrupted run. Without `augment`, the same examples
  in the same order come as eval sees images: no random ops, no mixing.
  """
  epochs = range(start_epoch, config.num_epochs)
  if config.input_backend == 'torch':
    epoch_batches = functools.partial(_torch_batches, split, config.seed, batch_size)
  elif isinstance(split, Streamed):
    def epoch_batches(epoch):
      seed = epoch_seed(config.seed, epoch)
      # The shuffle buffer holds config.shuffle_buffer_size decoded uint8 examples: the memory
      # that streaming needs, whatever the split's size.
      return (split.examples(seed).shuffle(config.shuffle_buffer_size, seed=seed)
              .batch(batch_size, drop_remainder=True))
  else:
    examples = tf.data.Dataset.from_tensor_slices({'image': split.images, 'label': split.labels})
    def epoch_batches(epoch):
      return (examples.shuffle(config.shuffle_buffer_size, seed=epoch_seed(config.seed, epoch),
                               reshuffle_each_iteration=False)
              .batch(batch_size, drop_remainder=True))
  for epoch in epochs:
    seed = epoch_seed(config.seed, epoch)

    def prepare(index: tf.Tensor, batch: dict[str, tf.Tensor], seed=seed, epoch=epoch) -> Batch:
      if not augment:
        return {'image': data.preprocess.eval_batch(batch['image']), 'label': batch['label']}
      seeds = tf.stack([tf.constant(seed, tf.int64), index])
      prepared = {'image': data.preprocess.train_batch(batch['image'], seeds),
                  'label': batch['label']}
      if not mixes(config):
        return prepared
      if epoch < config.num_epochs - config.unmixed_last_epochs:
        prepared['image'], prepared['target'] = mix.mix(
            prepared['image'], batch['label'], data.info.num_classes,
            tf.random.experimental.stateless_fold_in(seeds, 1), config.mixup_alpha,
            config.cutmix_alpha)
      else:  # One-hot targets: the batches keep their structure (no recompile).
        prepared['target'] = tf.one_hot(batch['label'], data.info.num_classes)
      return prepared

    # Batches are numbered before the ones already trained on are skipped, so each batch's
    # augmentation seed (config.seed, epoch, batch number) is the same in a resumed run.
    batches = (epoch_batches(epoch).enumerate()
               .skip(start_step if epoch == start_epoch else 0)
               .map(prepare, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True))
    yield from _numpy_batches(batches)


def _torch_batches(split: base.Split, seed: int, batch_size: int,
                   epoch: int) -> tf.data.Dataset:
  """One epoch of uint8 batches from a torch DataLoader (fully shuffled from the epoch's seed),
  as a tf.data dataset: the classic "PyTorch loads, JAX computes" pipeline."""
  from torch.utils import data as torch_data  # pylint: disable=g-import-not-at-top  (optional)
  import torch  # pylint: disable=g-import-not-at-top

  def collate(examples: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    images, labels = zip(*examples)
    return np.stack(images), np.asarray(labels, np.int32)

  examples = list(zip(split.images, split.labels))  # A list is a map-style dataset.
  loader = torch_data.DataLoader(
      examples, batch_size=batch_size, shuffle=True, drop_last=True, collate_fn=collate,
      generator=torch.Generator().manual_seed(epoch_seed(seed, epoch)))
  shape = (batch_size, *split.images.shape[1:])
  return tf.data.Dataset.from_generator(
      lambda: ({'image': images, 'label': labels} for images, labels in loader),
      output_signature={'image': tf.TensorSpec(shape, tf.uint8),
                        'label': tf.TensorSpec((batch_size,), tf.int32)})


def _numpy_batches(batches: tf.data.Dataset) -> Iterator[Batch]:
  # tf.data's autotuning is off: with it on, reaching the end of the last epoch sometimes took
  # as long as the whole run had taken (about 1 run in 3 here, TF 2.21: a `main.py` that hung
  # after its last checkpoint). Two batches ahead is all the train loop consumes.
  options = tf.data.Options()
  options.autotune.enabled = False
  yield from batches.prefetch(_PREFETCH_BATCHES).with_options(options).as_numpy_iterator()


def eval_batches(split: base.Split | Streamed, preprocess: preprocessing.Preprocessing,
                 batch_size: int, num_batches: int | None = None,
                 place: Callable[[Batch], Batch] = lambda batch: batch,
                 ) -> 'list[Batch] | StreamedBatches':
  """The whole split as equal-sized batches, each example exactly once, preprocessed for eval.

  The last batch is padded with zero images; `mask` is True for real examples and False for
  padding, so every batch has one compiled shape and padding never counts. `num_batches` pads
  further, to that many batches (so that every process runs the same number of eval steps).
  `place` puts each batch where it is used (e.g. sharded on the devices). An in-memory split
  gives a list; a streamed one gives `StreamedBatches`, which reads the split on every pass.
  """
  num_examples = split.num_examples if isinstance(split, Streamed) else len(split.labels)
  pad = (num_batches * batch_size - num_examples if num_batches is not None
         else -num_examples % batch_size)
  if isinstance(split, Streamed):
    return StreamedBatches(split, preprocess, batch_size, pad, place)
  mask = np.concatenate([np.ones(num_examples, np.bool_), np.zeros(pad, np.bool_)])
  images = np.concatenate([split.images, np.zeros((pad, *split.images.shape[1:]), np.uint8)])
  labels = np.concatenate([split.labels, np.zeros(pad, np.int32)])
  dataset = (tf.data.Dataset.from_tensor_slices({'image': images, 'label': labels, 'mask': mask})
             .batch(batch_size)
             .map(functools.partial(_eval_prepare, preprocess))
             .prefetch(tf.data.AUTOTUNE))
  return [place(batch) for batch in dataset.as_numpy_iterator()]


def _eval_prepare(preprocess: preprocessing.Preprocessing,
                  batch: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
  return {**batch, 'image': preprocess.eval_batch(batch['image'])}


class StreamedBatches:
  """The eval batches of a streamed split: an iterable that reads the split on every pass."""

  def __init__(self, split: Streamed, preprocess: preprocessing.Preprocessing, batch_size: int,
               pad: int, place: Callable[[Batch], Batch]):
    self._split, self._preprocess = split, preprocess
    self._batch_size, self._pad, self._place = batch_size, pad, place

  def __iter__(self) -> Iterator[Batch]:
    real = self._split.examples(None).map(lambda example: {**example, 'mask': True})
    padding = tf.data.Dataset.from_tensors({
        'image': tf.zeros(self._split.image_shape, tf.uint8), 'label': tf.constant(0, tf.int32),
        'mask': tf.constant(False)}).repeat(self._pad)
    batches = (real.concatenate(padding).batch(self._batch_size)
               .map(functools.partial(_eval_prepare, self._preprocess))
               .prefetch(_PREFETCH_EVAL))
    for batch in batches.as_numpy_iterator():
      yield self._place(batch)
