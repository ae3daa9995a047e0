"""Input pipeline: a data source's splits, preprocessed, as NumPy batches for JAX.

`Input` is how a run reads its data, resolved from the config by `training/run_spec.py`.
`open_data` opens its source and checks the splits: the `DatasetInfo` the model is built for.
`open_split` chooses, once, how a split is read, as `Input` says: one of three `OpenedSplit`s,
each giving a training epoch's batches (`epoch`) and the eval batches (`eval_batches`):

- `InMemory`: decoded once into NumPy arrays; tf.data shuffles and batches them.
- `TorchLoaded` (`config.input_backend='torch'`): the same arrays, shuffled and batched by a
  torch DataLoader: the classic "PyTorch loads, JAX computes" pipeline.
- `Streamed`: read from the source's files on every pass, decoded in parallel, never whole in
  memory; only the shuffle buffer (or the decoded cache) is.

Images are resized (the preprocessing's first stage) where they are decoded and stay uint8 until
batched. A crop op (`random_resized_crop`) cuts each training image before batching, drawing its
window from (seed, epoch, the image's place in the epoch's order), so the images (or the file
names, or the cached copies) are shuffled before it cuts them. Its windows and resize are the
preprocessing's (`preprocessing.EpochCrops`); a source only decodes a window it is given, and an
image-file source decodes only that window of a JPEG. With the decoded cache
(`Input.decoded_cache`), a streamed split's images are decoded once, at `CACHE_SIDE` x the input
size, and every later epoch cuts its windows from that copy.

`train_batches` is the one training loop over any `OpenedSplit`: each epoch's batches are numbered,
those already trained on skipped, and each mapped through the preprocessing's random ops
(vectorised over the batch) and Mixup/CutMix, seeded by (seed, epoch, batch number), so a run
can restart at any step and see the same data. Batches leave the host as uint8 (unless a random
op or Mixup computes new pixel values: `Input.image_dtype`) and are scaled on the devices, inside
the compiled steps (`Preprocessing.scale`): the host does less and sends a quarter of the bytes.
Eval batches get the deterministic stages only (uint8), padded to equal sizes with a mask, and go
to the devices one at a time. `batch_layout` is the one description of a batch's arrays, for
compiling ahead.
"""

import abc
import collections
from collections.abc import Callable, Iterator
import concurrent.futures
import dataclasses
import functools
import math
import os
from typing import NamedTuple

from absl import logging
import jax
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from core import errors
from data_sources import base
import preprocessing
from preprocessing import mix
from preprocessing import resize as resize_ops

Batch = dict[str, np.ndarray]
IN_MEMORY = ('auto', 'always', 'never')
DECODED_CACHE = ('auto', 'memory', 'off')
# The decoded cache holds images with the shorter side at most this many times the model's
# input size: room for the crop op's windows at little more than a copy at the input size.
CACHE_SIDE = 1.15
INPUT_BACKENDS = ('tf', 'torch')
# in_memory='auto' keeps a split in memory when its uint8 pixels, at the size it holds them (a
# training split with a crop op: before the crop), fit in this share of physical memory. Batches
# leave the host as uint8 too, so no float32 copy is held, and an eval split's batches are views
# of its arrays.
MEMORY_SHARE = 0.25
_MAP_BLOCK = 1024  # Examples resized per tf.data map call.
_PREFETCH_BATCHES = 2  # Training batches prepared ahead of the train loop.
_PREFETCH_EVAL = 2  # Eval batches prepared ahead.
_FEW_EXAMPLES = 10  # A class with fewer training examples than this gets a warning.


@dataclasses.dataclass(frozen=True)
class Input:
  """How a run reads its data: the source, the training split, its preprocessing and batching.

  `in_memory`: 'always' decodes each split into memory once, 'never' streams it from its files
  on every pass, 'auto' keeps it in memory when it fits `MEMORY_SHARE` of the machine's memory.
  `decoded_cache`: for a streamed training split with a crop op, the images decoded once and
  shrunk (shorter side `CACHE_SIDE` x the input size), kept in memory ('memory'; 'auto': when
  it fits `MEMORY_SHARE` and `in_memory` is not 'never'), or 'off': every epoch decodes the
  files again.
  Mixing (Mixup/CutMix, soft targets) is on when an alpha is, but in the last
  `unmixed_last_epochs` epochs.
  """
  source: Callable[[], base.DataSource]  # Opens the data source.
  can_stream: bool  # Whether the source streams splits from its files.
  preprocess: preprocessing.Preprocessing
  train_split: str = 'train'
  in_memory: str = 'auto'
  decoded_cache: str = 'auto'
  shuffle_buffer_size: int = 60_000
  backend: str = 'tf'  # 'tf' (tf.data) or 'torch' (a DataLoader shuffles and batches).
  seed: int = 0
  num_epochs: int = 1
  mixup_alpha: float = 0.0
  cutmix_alpha: float = 0.0
  unmixed_last_epochs: int = 0

  @property
  def mixes(self) -> bool:
    """Whether training batches are mixed (Mixup or CutMix), with soft targets."""
    return bool(self.mixup_alpha or self.cutmix_alpha)

  @property
  def image_dtype(self) -> type:
    """The dtype of training batches' images: uint8, or float32 in [0, 1] when a random op
    computes new pixel values (`Preprocessing.keeps_uint8`) or batches are mixed."""
    return np.uint8 if self.preprocess.keeps_uint8 and not self.mixes else np.float32


@dataclasses.dataclass(frozen=True)
class Data:
  """An opened data source with the run's preprocessing, the metadata of its splits, and the
  size of each evaluation's split (by evaluation name)."""
  source: base.DataSource
  preprocess: preprocessing.Preprocessing
  info: base.DatasetInfo
  eval_sizes: dict[str, int] = dataclasses.field(default_factory=dict)


class EvalSplit(NamedTuple):
  """An evaluation's split: the config key that names it (for messages), the split, and the
  preprocessing its images get."""
  key: str
  split: str
  preprocess: preprocessing.Preprocessing


def open_data(inputs: Input, eval_splits: dict[str, EvalSplit]) -> Data:
  """`inputs`' source with its preprocessing; the training split and each evaluation's split
  (by evaluation name) checked, and that its preprocessing makes the model's images; nothing
  decoded."""
  source = inputs.source()
  image_shape = inputs.preprocess.image_shape(source.image_shape, source.name)
  eval_sizes = {}
  for name, (key, split, preprocess) in eval_splits.items():
    eval_sizes[name] = source.split_size(key, split)
    if (shape := preprocess.image_shape(source.image_shape, source.name)) != image_shape:
      raise errors.ConfigError(
          f'config.{preprocess.key}={preprocess.spec!r} makes {shape} images for evaluation '
          f'{name!r}, but the model takes {image_shape}: resize to the training size.',
          key=preprocess.key, value=preprocess.spec)
  info = base.DatasetInfo(
      name=source.name, image_shape=image_shape,
      num_classes=source.num_classes,
      num_train_examples=source.split_size('train_split', inputs.train_split),
      num_eval_examples=eval_sizes.get('eval', 0), num_test_examples=eval_sizes.get('test', 0),
      class_names=tuple(source.class_names))
  return Data(source, inputs.preprocess, info, eval_sizes)


def batch_layout(info: base.DatasetInfo, batch_size: int, *, train: Input | None = None,
                 mask: bool = False) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """{name: (shape, dtype)} of a batch of `batch_size`, for compiling ahead: the layout
  `train_batches` gives for `train` (its `image_dtype`, soft targets when it mixes), or without
  it the one `eval_batches` gives (uint8 images, with `mask`)."""
  image_dtype = np.uint8 if train is None else train.image_dtype
  layout = {'image': ((batch_size, *info.image_shape), image_dtype),
            'label': ((batch_size,), np.int32)}
  if train is not None and train.mixes:
    layout['target'] = ((batch_size, info.num_classes), np.float32)
  if mask:
    layout['mask'] = ((batch_size,), np.bool_)
  return layout


def epoch_seed(seed: int, epoch):
  """The shuffle seed of one epoch (an int or tf.int64 tensor): distinct per (seed, epoch)."""
  return seed * 2**20 + epoch  # Distinct for epochs below 2**20.


def process_split(split: str, drop_remainder: bool = False) -> base.SplitArg:
  """This process's slice of `split`; the split itself in a single-process run.

  With `drop_remainder`, all slices have the same size (the remainder is dropped). Slices are
  TFDS read instructions, which every data source resolves (TFDS's own, and the sources built
  on `base.RangeSource`: image folders, Hugging Face, torchvision).
  """
  if jax.process_count() == 1:
    return split
  return tfds.split_for_jax_process(split, drop_remainder=drop_remainder)


class OpenedSplit(abc.ABC):
  """A split as the pipeline reads it: `open_split` chooses the kind once, for the run."""
  num_examples: int  # Of the split (this process's slice).

  @abc.abstractmethod
  def epoch(self, inputs: Input, seed: int, batch_size: int, augment: bool) -> tf.data.Dataset:
    """One training epoch of uint8 batches of `batch_size` (an incomplete last one dropped), in
    the order of the epoch's `seed`; with `augment`, a crop op's windows are drawn, else its
    images are cut as eval cuts them."""

  @abc.abstractmethod
  def eval_batches(self, batch_size: int, pad: int) -> Iterator[Batch]:
    """Every example once, in the source's order, then `pad` zero images, in batches of
    `batch_size` with 'mask' False for the padding."""


@dataclasses.dataclass(frozen=True)
class InMemory(base.Split, OpenedSplit):
  """A split decoded once into memory; tf.data shuffles and batches its arrays. A training split
  with a crop op holds its images before the crop (stage 1), which each epoch cuts one by one."""

  @property
  def num_examples(self) -> int:
    return len(self.labels)

  @functools.cached_property
  def _tensors(self) -> dict[str, tf.Tensor]:
    """The arrays as tensors, copied once: every epoch gathers its examples from them."""
    with tf.init_scope():  # Eager, even when first read while tf.data traces a function.
      return {'image': tf.constant(self.images), 'label': tf.constant(self.labels)}

  def _gather(self, indices: tf.Tensor) -> Batch:
    return {name: tf.gather(values, indices) for name, values in self._tensors.items()}

  def epoch(self, inputs: Input, seed: int, batch_size: int, augment: bool) -> tf.data.Dataset:
    # The buffer shuffles indices, not images: the same order as shuffling the examples (the
    # same seed draws the same buffer slots), a buffer that fills faster, and whole batches
    # gathered at once.
    order = tf.data.Dataset.range(self.num_examples).shuffle(
        inputs.shuffle_buffer_size, seed=seed, reshuffle_each_iteration=False)
    crop_op = inputs.preprocess.crop_op
    if crop_op is None:
      return order.batch(batch_size, drop_remainder=True).map(self._gather)
    examples = order.map(self._gather)  # Images before the crop: cut one by one.
    examples = (inputs.preprocess.crops(seed).each(examples) if augment
                else _mapped(examples, crop_op.eval_op))
    return examples.batch(batch_size, drop_remainder=True)

  def eval_batches(self, batch_size: int, pad: int) -> Iterator[Batch]:
    """Views of the arrays (the split is held once); only a padded batch is a copy."""
    for start in range(0, self.num_examples + pad, batch_size):
      real = self.labels[start:start + batch_size]
      batch = {'image': self.images[start:start + batch_size], 'label': real,
               'mask': np.ones(len(real), np.bool_)}
      if (missing := batch_size - len(real)):
        batch = {name: np.concatenate([values, np.zeros((missing, *values.shape[1:]),
                                                        values.dtype)])
                 for name, values in batch.items()}
      yield batch


@dataclasses.dataclass(frozen=True)
class TorchLoaded(InMemory):
  """A split in memory whose training epochs a torch DataLoader shuffles (fully, from the
  epoch's seed) and batches; tf.data then maps the batches as for the others. Takes no crop op
  (`run_spec` refuses one with this backend)."""

  def epoch(self, inputs: Input, seed: int, batch_size: int, augment: bool) -> tf.data.Dataset:
    from torch.utils import data as torch_data  # pylint: disable=g-import-not-at-top  (optional)
    import torch  # pylint: disable=g-import-not-at-top

    def collate(examples: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
      images, labels = zip(*examples)
      return np.stack(images), np.asarray(labels, np.int32)

    loader = torch_data.DataLoader(
        list(zip(self.images, self.labels)),  # A list is a map-style dataset.
        batch_size=batch_size, shuffle=True, drop_last=True, collate_fn=collate,
        generator=torch.Generator().manual_seed(seed))
    return tf.data.Dataset.from_generator(
        lambda: ({'image': images, 'label': labels} for images, labels in loader),
        output_signature={
            'image': tf.TensorSpec((batch_size, *self.images.shape[1:]), tf.uint8),
            'label': tf.TensorSpec((batch_size,), tf.int32)})


def in_memory(split: base.Split, inputs: Input) -> InMemory:
  """`split`'s arrays, read for training by the backend `inputs` names."""
  return (TorchLoaded if inputs.backend == 'torch' else InMemory)(split.images, split.labels)


@dataclasses.dataclass(frozen=True)
class Streamed(OpenedSplit):
  """A split read from its source's files on every pass; only tf.data's buffers are in memory."""
  # shuffle seed (None: the source's order) -> {'image': uint8 image_shape, 'label': int32},
  # images as eval prepares them.
  examples: Callable[[int | None], tf.data.Dataset]
  num_examples: int
  image_shape: tuple[int, int, int]
  # -> the decoded examples a training epoch's shuffle holds (`_shuffle_buffer`), worked out
  # (and warned about) once, by the first shuffle that needs it: eval never shuffles.
  shuffle_buffer: Callable[[], int]
  # A training split of a run with a crop op: epoch seed -> the examples shuffled in that
  # epoch's order, each image cut by the crop op (`_crops`, or `_cached_crops`).
  cropped: Callable[[int], tf.data.Dataset] | None = None

  def epoch(self, inputs: Input, seed: int, batch_size: int, augment: bool) -> tf.data.Dataset:
    if augment and self.cropped:  # Shuffled before the crops.
      examples = self.cropped(seed)
    else:  # The shuffle buffer holds `shuffle_buffer()` decoded uint8 examples: the memory
      # that streaming needs, whatever the split's size.
      examples = self.examples(seed).shuffle(self.shuffle_buffer(), seed=seed)
    return examples.batch(batch_size, drop_remainder=True)

  def eval_batches(self, batch_size: int, pad: int) -> Iterator[Batch]:
    real = self.examples(None).map(lambda example: {**example, 'mask': True})
    padding = tf.data.Dataset.from_tensors({
        'image': tf.zeros(self.image_shape, tf.uint8), 'label': tf.constant(0, tf.int32),
        'mask': tf.constant(False)}).repeat(pad)
    return real.concatenate(padding).batch(batch_size).prefetch(
        _PREFETCH_EVAL).as_numpy_iterator()


def open_split(data: Data, split: base.SplitArg, inputs: Input,
               preprocess: preprocessing.Preprocessing | None = None) -> OpenedSplit:
  """`split` of the source with its images resized (by `preprocess`, default the run's), in
  memory or streamed, as `inputs.in_memory` says (sources that cannot stream always load into
  memory).

  Without `preprocess`, the training split: with a crop op in the run's preprocessing, it holds
  its images before the crop (stage 1 only), which its epochs cut image by image. Such a split
  whose images vary in size until cut (no image op gives them one size) is streamed: the crop
  takes its window from the image as decoded, which no array of one size holds.
  """
  source = data.source
  training_crop = preprocess is None and data.preprocess.crop_op is not None
  preprocess = preprocess or data.preprocess
  num_examples = source.num_examples(split)
  held_shape = (preprocess.shape_before_crop(source.image_shape) if training_crop
                else data.info.image_shape)
  if None in held_shape or not _keeps_in_memory(inputs, split, num_examples, held_shape):
    logging.info('Streaming split %r of %s (%d examples) from its files%s.', split, source.name,
                 num_examples, ': its crop op cuts images of varying sizes as they are decoded'
                 if None in held_shape else '')
    return _streamed(data, split, inputs, preprocess, training_crop, held_shape)
  prepare = preprocess.before_crop if training_crop else preprocess.resize
  return in_memory(_loaded(source, split, prepare, held_shape), inputs)


def _mapped(examples: tf.data.Dataset, prepare: Callable[[tf.Tensor], tf.Tensor],
            shape: tuple[int | None, int | None, int] | None = None) -> tf.data.Dataset:
  """`examples` with `prepare` applied to each image (of `shape`, when given), in order."""
  def mapped(example):
    image = prepare(example['image'])
    return {**example, 'image': image if shape is None else tf.ensure_shape(image, shape)}
  return examples.map(mapped, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _loaded(source: base.DataSource, split: base.SplitArg,
            prepare: Callable[[tf.Tensor], tf.Tensor], shape: tuple[int, int, int]
            ) -> base.Split:
  """`split` decoded into memory, its images prepared by `prepare` (to `shape`)."""
  if None in source.image_shape[:2]:  # Images of varying sizes: prepared as they are decoded.
    return base.materialize(_mapped(source.examples(split), prepare, shape))
  loaded = source.load_split(split)
  if loaded.images.shape[1:] == shape:
    return loaded
  images = (tf.data.Dataset.from_tensor_slices(loaded.images).batch(_MAP_BLOCK)
            .map(prepare).as_numpy_iterator())
  return base.Split(images=np.concatenate(list(images)), labels=loaded.labels)


def _streamed(data: Data, split: base.SplitArg, inputs: Input,
              preprocess: preprocessing.Preprocessing, training_crop: bool,
              held_shape: tuple[int | None, int | None, int]) -> Streamed:
  """`split` read from its files on every pass (`Streamed`): with `training_crop`, its
  epochs' crops too."""
  source, image_shape = data.source, data.info.image_shape
  num_examples = source.num_examples(split)
  shuffle_buffer = functools.cache(functools.partial(
      _shuffle_buffer, inputs, split, num_examples, math.prod(image_shape)))
  cropped = None
  if training_crop and (side := _cache_side(inputs, split, num_examples, image_shape)):
    cropped = _cached_crops(source, split, num_examples, preprocess, side)
  elif training_crop:
    cropped = functools.partial(_crops, source, split, preprocess, held_shape, shuffle_buffer)
  return Streamed(lambda seed: _mapped(source.examples(split, seed), preprocess.resize,
                                       image_shape),
                  num_examples, image_shape, shuffle_buffer, cropped)


def _crops(source: base.DataSource, split: base.SplitArg,
           preprocess: preprocessing.Preprocessing,
           held_shape: tuple[int | None, int | None, int], shuffle_buffer: Callable[[], int],
           seed: int) -> tf.data.Dataset:
  """The epoch of `seed` of a streamed `split`, each image cut by the crop op: the source
  decodes only each window, unless image ops come before the crop op (then the windows are cut
  from their images).

  The shuffle comes before the crops (each window is drawn from the image's place in the
  epoch's order): of the file names where the source shuffles whole splits, holding no pixels.
  Only a source that shuffles its files' order alone has its crops shuffled again, in a buffer
  of `shuffle_buffer` crops.
  """
  crops = preprocess.crops(seed)
  if preprocess.image_ops:
    examples = crops.each(_mapped(source.examples(split, seed), preprocess.before_crop,
                                  held_shape))
  else:
    examples = _mapped(source.windowed_examples(split, seed, crops.window), crops.op.resize)
  return (examples if source.SHUFFLES_EXAMPLES
          else examples.shuffle(shuffle_buffer(), seed=seed))


def _cached_crops(source: base.DataSource, split: base.SplitArg, num_examples: int,
                  preprocess: preprocessing.Preprocessing,
                  side: int) -> Callable[[int], tf.data.Dataset]:
  """Epoch seed -> the crops of `split`'s decoded cache: its images decoded once (while the
  first epoch reads them), shrunk to a shorter side of at most `side` and held in memory;
  every epoch shuffles them all (the buffer holds references to the cached images) and cuts
  its windows from them."""
  cached = _mapped(source.examples(split),
                   lambda image: _shrunk(preprocess.before_crop(image), side)).cache()
  return lambda seed: preprocess.crops(seed).each(cached.shuffle(num_examples, seed=seed))


def _shrunk(image: tf.Tensor, side: int) -> tf.Tensor:
  """A uint8 image with its shorter side at most `side` (the aspect ratio kept)."""
  return tf.cond(tf.reduce_min(tf.shape(image)[:2]) > side,
                 lambda: resize_ops.resize_images(
                     image, resize_ops.fitted_size(image, side, cover=True)),
                 lambda: image)


def _cache_side(inputs: Input, split: base.SplitArg, num_examples: int,
                image_shape: tuple[int, int, int]) -> int | None:
  """The shorter side of the decoded cache's images of a streamed training split, or None
  without a cache (as `inputs.decoded_cache` says). Its size is estimated at 4:3 images (the
  cached images' sizes are known once decoded)."""
  side = math.ceil(CACHE_SIDE * max(image_shape[:2]))
  size = num_examples * side * math.ceil(side * 4 / 3) * image_shape[2]
  if inputs.decoded_cache == 'off' or (inputs.decoded_cache == 'auto' and (
      inputs.in_memory == 'never' or size > _memory_budget())):
    return None
  logging.info("decoded_cache=%r: split %r decoded once, shorter side at most %d px (about %.0f "
               'MB as uint8), kept in memory; the crops of every epoch are cut from that copy.',
               inputs.decoded_cache, split, side, size / 2**20)
  return side


def _shuffle_buffer(inputs: Input, split: base.SplitArg, num_examples: int,
                    example_bytes: int) -> int:
  """The shuffle buffer of a streamed split whose decoded examples take `example_bytes` each:
  `inputs.shuffle_buffer_size`, capped (with a warning) where the examples it would hold do not
  fit `MEMORY_SHARE` of the memory: the default 60,000 was sized for digits, and 60,000 photos
  at 224 px are 9 GB. The cap depends on the machine's memory: a run resumed on a machine with
  less may shuffle in a smaller buffer."""
  fitting = max(1, int(_memory_budget() // example_bytes))
  if min(num_examples, inputs.shuffle_buffer_size) <= fitting:
    return inputs.shuffle_buffer_size
  logging.warning('config.shuffle_buffer_size=%d: split %r streams %d-byte examples, and the '
                  'buffer holds at most %d of them in %.0f%% of memory; shuffling in that many.',
                  inputs.shuffle_buffer_size, split, example_bytes, fitting, MEMORY_SHARE * 100)
  return fitting


def _memory_budget() -> float:
  """Bytes that in_memory='auto' (and decoded_cache='auto') may hold: `MEMORY_SHARE`."""
  return MEMORY_SHARE * os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')


def _keeps_in_memory(inputs: Input, split: base.SplitArg, num_examples: int,
                     image_shape: tuple[int, int, int]) -> bool:
  """Whether `split` is held in memory, as `inputs.in_memory` says: with 'auto', when its
  uint8 images of `image_shape` fit `MEMORY_SHARE` of the memory (or it cannot stream)."""
  if inputs.in_memory != 'auto' or not inputs.can_stream or inputs.backend == 'torch':
    return inputs.in_memory != 'never'
  size = num_examples * math.prod(image_shape)  # uint8: a byte a value.
  budget = _memory_budget()
  logging.info("in_memory='auto': split %r takes %.0f MB as uint8 %s images, %s %.0f MB "
               '(%.0f%% of memory): %s.', split, size / 2**20, 'x'.join(map(str, image_shape)),
               'within' if size <= budget else 'over', budget / 2**20, MEMORY_SHARE * 100,
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


def train_batches(split: OpenedSplit, data: Data, inputs: Input, batch_size: int,
                  start_epoch: int = 0, start_step: int = 0,
                  augment: bool = True) -> Iterator[Batch]:
  """Yields training batches from batch `start_step` of `start_epoch` to the end of the run.

  Each batch is {'image': (batch_size, H, W, C) `inputs.image_dtype`, 'label': (batch_size,)
  int32}, through the random ops (the scale stage is the compiled step's), and with Mixup or
  CutMix 'target': (batch_size, classes) float32 soft targets; an incomplete final batch of an
  epoch is dropped (static shapes).
  Every epoch is shuffled and augmented from its own seed (`epoch_seed`), so resuming at any
  step gives the same batches as the uninterrupted run. Without `augment`, the same examples
  in the same order come as eval sees images: no random ops, no mixing.
  """
  for epoch in range(start_epoch, inputs.num_epochs):
    prepare = (functools.partial(_augmented, inputs, data.info, epoch) if augment
               else lambda index, batch: batch)
    # Batches are numbered before the ones already trained on are skipped, so each batch's
    # augmentation seed (config.seed, epoch, batch number) is the same in a resumed run.
    batches = (split.epoch(inputs, epoch_seed(inputs.seed, epoch), batch_size, augment)
               .enumerate().skip(start_step if epoch == start_epoch else 0)
               .map(prepare, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True))
    # tf.data's autotuning is off: with it on, reaching the end of the last epoch sometimes took
    # as long as the whole run had taken (about 1 run in 3 here, TF 2.21: a `main.py` that hung
    # after its last checkpoint). Two batches ahead is all the train loop consumes.
    options = tf.data.Options()
    options.autotune.enabled = False
    yield from batches.prefetch(_PREFETCH_BATCHES).with_options(options).as_numpy_iterator()


def read_ahead(batches: Iterator[Batch], size: int = _PREFETCH_BATCHES) -> Iterator[Batch]:
  """`batches`, read up to `size` ahead by a background thread, across epoch ends too: while
  the loop runs an epoch's end (saves, evaluations), the next epoch's pipeline starts and fills
  its shuffle buffer. tf.data's own prefetch cannot: each epoch is its own iterator, started by
  its first read."""
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as reader:  # Reads in order.
    pending = collections.deque(reader.submit(next, batches, None) for _ in range(size))
    while (batch := pending.popleft().result()) is not None:
      pending.append(reader.submit(next, batches, None))
      yield batch


def _augmented(inputs: Input, info: base.DatasetInfo, epoch: int, index: tf.Tensor,
               batch: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
  """Batch `index` of `epoch` through the random ops and, in the mixed epochs, Mixup/CutMix
  (soft targets; one-hot in the last `inputs.unmixed_last_epochs`, so that the batches keep
  their structure and nothing recompiles)."""
  seeds = tf.stack([tf.constant(epoch_seed(inputs.seed, epoch), tf.int64), index])
  augmented = {'image': inputs.preprocess.train_batch(batch['image'], seeds),
               'label': batch['label']}
  if not inputs.mixes:
    return augmented
  augmented['image'] = inputs.preprocess.unit(augmented['image'])  # Mixup blends in float32.
  if epoch < inputs.num_epochs - inputs.unmixed_last_epochs:
    augmented['image'], augmented['target'] = mix.mix(
        augmented['image'], batch['label'], info.num_classes,
        tf.random.experimental.stateless_fold_in(seeds, 1), inputs.mixup_alpha,
        inputs.cutmix_alpha)
  else:
    augmented['target'] = tf.one_hot(batch['label'], info.num_classes)
  return augmented


def open_eval_batches(data: Data, inputs: Input, split: str, num_examples: int,
                      batch_size: int, preprocess: preprocessing.Preprocessing | None = None,
                      place: Callable[[Batch], Batch] = lambda batch: batch) -> 'EvalBatches':
  """The whole `split` (`num_examples` over all processes) as `eval_batches` of `batch_size`
  examples over all processes, prepared by `preprocess` (default: the run's).

  Each process loads its slice (sizes differ by at most one) and pads it to as many batches as
  the largest slice needs, so all processes run the same number of eval steps.
  """
  preprocess = preprocess or data.preprocess
  local_batch = batch_size // jax.process_count()
  largest_slice = -(-num_examples // jax.process_count())
  return eval_batches(open_split(data, process_split(split), inputs, preprocess), local_batch,
                      -(-largest_slice // local_batch), place)


def eval_batches(split: OpenedSplit, batch_size: int, num_batches: int | None = None,
                 place: Callable[[Batch], Batch] = lambda batch: batch) -> 'EvalBatches':
  """The whole split as equal-sized batches, each example exactly once, prepared for eval.

  The last batch is padded with zero images; `mask` is True for real examples and False for
  padding, so every batch has one compiled shape and padding never counts. `num_batches` pads
  further, to that many batches. `place` puts each batch where it is used (e.g. sharded on the
  devices), one at a time.
  """
  pad = (num_batches * batch_size - split.num_examples if num_batches is not None
         else -split.num_examples % batch_size)
  return EvalBatches(split, batch_size, pad, place)


class EvalBatches:
  """The eval batches of a split, an iterable: `OpenedSplit.eval_batches`, read again and placed one
  by one on every pass."""

  def __init__(self, split: OpenedSplit, batch_size: int, pad: int,
               place: Callable[[Batch], Batch]):
    self._split, self._place = split, place
    self._batch_size, self._pad = batch_size, pad

  def __iter__(self) -> Iterator[Batch]:
    for batch in self._split.eval_batches(self._batch_size, self._pad):
      yield self._place(batch)
