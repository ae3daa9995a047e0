"""The preprocessing language: one description of how images reach the model, for every mode.

`config.preprocess` is a string of ops joined by '|', each a name with optional Python-literal
arguments, in the style of big_vision's preprocessing strings:

    'resize(32, method="crop")|random_crop(32, pad=4)|flip_lr|normalize((0.5,), (0.25,))'

Every image is decoded to uint8, then goes through the ops in four stages, in this order:
  1. `image` ops, one image at a time, deterministic: `resize`, `resize_small`, `central_crop`
     give images of any size one size;
  2. at most one `crop` op, one uint8 image at a time, before batching: `random_resized_crop`,
     a random window of the image as decoded (or as the image ops left it), resized once;
  3. `random` ops, on batches, training only: the augmentation. Ops registered with
     `uint8=True` move or mirror pixels without computing new values (`flip_lr`, `random_crop`,
     `translate`) and run on the uint8 batch; when any other op is there (colour jitter,
     rotation, RandAugment, ...) the batch becomes float32 in [0, 1] first and stays float32;
  4. at most one `scale` op, deterministic: `normalize`, `value_range` or `standardize`
     (without one, pixels stay in [0, 1]), on the devices, inside the compiled train and eval
     steps (`scale`).
Batches therefore leave the host as uint8 (a quarter of float32's bytes) unless a random op
computes new pixel values or Mixup blends images: then float32 in [0, 1]. Those values fall
between uint8's levels, and rounding them back would change the images trained on by up to
1/510 per pixel, an accuracy cost nobody has measured; so they are sent as they are.
Training applies all four; eval, predict and the exported model apply stages 1 and 4, with the
crop op's deterministic stand-in (its `eval_op`: for random_resized_crop, the shorter side
resized to size / crop_pct and the centre size x size) in place of stage 2, so that every mode
sees the images training saw. Random ops draw from TensorFlow's stateless random ops seeded per
batch by the input pipeline from (config.seed, epoch, batch number), and the crop op per image
from (config.seed, epoch, the image's place in the epoch's order), so the same seed gives the
same batches and a resumed run continues with the draws of the uninterrupted one.

Ops are registered in the modules of this package with `@OPS.register(name, stage=...)`; a new op
is one function in one file here.
"""

from collections.abc import Callable
import dataclasses
import math

import numpy as np
import tensorflow as tf

from core import errors
from core import registry

OPS = registry.Registry('preprocessing op', package='preprocessing')
STAGES = ('image', 'crop', 'random', 'scale')
_ONE_OP_STAGES = ('crop', 'scale')  # Stages of at most one op.
_KEY = 'preprocess'
# Sizes (height, width) of the blank images that find the output shape of the `image` ops: two
# aspect ratios, so that ops whose output follows the input's size are seen to vary.
_PROBE_SIZES = ((8, 12), (12, 8))
_IMAGE_SEED_TAG = 2  # Folded into (epoch seed, index) for a crop op's seed (mix.py folds in 1).

ImageOp = Callable[[tf.Tensor], tf.Tensor]  # uint8 image(s) (..., H, W, C) -> uint8 image(s)
RandomOp = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]  # (batch, seed [2]) -> batch
ScaleOp = Callable[[tf.Tensor], tf.Tensor]  # float32 batch in [0, 1] -> float32 batch


@dataclasses.dataclass(frozen=True)
class CropOp:
  """A `crop` stage op: a random window of one uint8 image (H, W, C) of any size, resized.

  Split in two so that a decoder can cut the window itself (only the window of a JPEG needs
  decoding): `window` draws it from the image's size, `resize` makes the window the output.
  `eval_op` is the deterministic image op that eval, predict and export run in its place;
  `eval_spec` writes it as image ops of this language, e.g. 'resize_small(256)|central_crop(224)'
  (what a fixed-size export's user applies before the model).
  """
  # (size: int32 [height, width], seed [2]) -> int32 [top, left, height, width].
  window: Callable[[tf.Tensor, tf.Tensor], tf.Tensor]
  resize: ImageOp
  eval_op: ImageOp
  eval_spec: str


def image_seed(epoch_seed, index: tf.Tensor) -> tf.Tensor:
  """The seed of a crop op's draw for the image at `index` of an epoch's order."""
  return tf.random.experimental.stateless_fold_in(
      tf.stack([tf.cast(epoch_seed, tf.int64), tf.cast(index, tf.int64)]), _IMAGE_SEED_TAG)


@dataclasses.dataclass(frozen=True)
class EpochCrops:
  """A crop op's draws for one epoch: the image at index i of the epoch's order is cut where
  the seed (epoch seed, i) says, whatever else runs (a resumed run cuts the same windows)."""
  op: CropOp
  epoch_seed: int | tf.Tensor

  def window(self, size: tf.Tensor, index: tf.Tensor) -> tf.Tensor:
    """The window [top, left, height, width] of the image of `size` at `index`."""
    return self.op.window(tf.cast(size, tf.int32), image_seed(self.epoch_seed, index))

  def __call__(self, image: tf.Tensor, index: tf.Tensor) -> tf.Tensor:
    """The image at `index`, cut and resized."""
    top, left, height, width = tf.unstack(self.window(tf.shape(image)[:2], index))
    return self.op.resize(tf.slice(image, [top, left, 0], [height, width, -1]))

  def each(self, examples: tf.data.Dataset) -> tf.data.Dataset:
    """`examples` ({'image', ...}, in the epoch's order) with every image cut."""
    return examples.enumerate().map(
        lambda index, example: {**example, 'image': self(example['image'], index)},
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


@dataclasses.dataclass(frozen=True)
class Preprocessing:
  """A parsed `config.preprocess` (or the config key `key`): its ops by stage."""
  spec: str
  key: str = _KEY
  image_ops: tuple[ImageOp, ...] = ()
  crop_op: CropOp | None = None
  random_ops: tuple[RandomOp, ...] = ()
  scale_op: ScaleOp | None = None
  keeps_uint8: bool = True  # Whether every random op runs on uint8 batches (stage 3).
  # `resize`'s stages 1 and 2 written as image ops (the crop op's `eval_spec`); '' for none.
  resize_spec: str = ''

  def resize(self, images: tf.Tensor, size: tuple[int, int] | None = None) -> tf.Tensor:
    """The deterministic stages 1 and 2 (the crop op's `eval_op`) on one uint8 image (H, W, C)
    or a batch of images of one size: the images of eval, predict and export.

    Without such ops every training image had the model's size; given that `size`, images of
    other sizes (to predict or serve) are stretched to it, as `resize(size)` would.
    """
    if not self.image_ops and self.crop_op is None and size is not None:
      from preprocessing import resize as resize_ops  # pylint: disable=g-import-not-at-top
      return resize_ops.resize_images(images, size)
    images = self.before_crop(images)
    return images if self.crop_op is None else self.crop_op.eval_op(images)

  def before_crop(self, images: tf.Tensor) -> tf.Tensor:
    """Stage 1 only: the images a training split holds for its crop op to cut."""
    for op in self.image_ops:
      images = op(images)
    return images

  def crops(self, epoch_seed) -> EpochCrops:
    """The crop op's draws for the epoch of `epoch_seed` (the op must exist)."""
    return EpochCrops(self.crop_op, epoch_seed)

  def shape_before_crop(self, source_shape: tuple[int | None, int | None, int]
                        ) -> tuple[int | None, int | None, int]:
    """The shape of `before_crop`'s images for images of `source_shape`: None where it
    varies."""
    return _output_shape(self.before_crop, source_shape)

  def augment(self, images: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """Stage 3 on a batch: each op with its own seed split from `seed`."""
    if not self.random_ops:
      return images
    seeds = tf.unstack(tf.random.experimental.stateless_split(seed, len(self.random_ops)))
    for op, op_seed in zip(self.random_ops, seeds):
      images = op(images, op_seed)
    return images

  @staticmethod
  def unit(images):
    """uint8 images as float32 in [0, 1]; float32 images (in [0, 1] already) as they are. On a
    TensorFlow tensor or a JAX array."""
    if images.dtype != np.uint8:
      return images
    if isinstance(images, tf.Tensor):
      return tf.cast(images, tf.float32) / 255.0
    return images.astype(np.float32) / np.float32(255.0)

  def scale(self, images):
    """Images as the model takes them: `unit`, then stage 4. On a TensorFlow tensor or, as
    well, a JAX array (the scale ops are arithmetic only): inside the compiled steps."""
    images = self.unit(images)
    return images if self.scale_op is None else self.scale_op(images)

  def train_batch(self, images: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """A batch of uint8 images after stage 3: uint8 when every random op `keeps_uint8`, else
    float32 in [0, 1]. `scale` makes it what the model takes."""
    return self.augment(images if self.keeps_uint8 else self.unit(images), seed)

  def image_shape(self, source_shape: tuple[int | None, int | None, int],
                  dataset: str) -> tuple[int, int, int]:
    """The model's input shape for images of `source_shape` (height/width None: varying).

    Checks that the random ops keep that shape. A `DataError` when sizes vary and no op
    resizes them; a `ConfigError` when a random op changes the size.
    """
    channels = source_shape[-1]
    shape = _output_shape(self.resize, source_shape)
    if None in shape:
      raise errors.DataError(
          f'The images of {dataset} vary in size: add a resize to config.preprocess, e.g. '
          f"--config.preprocess='resize(64)' for 64x64 (or 'resize(64, method=\"crop\")').",
          what=dataset)
    try:
      augmented = tuple(self.augment(tf.zeros((1, *shape)), tf.constant([0, 0])).shape[1:])
    except ValueError as error:
      raise errors.ConfigError(f'config.{self.key}={self.spec!r} does not fit {shape[0]}x'
                               f'{shape[1]} images: {error}.', key=self.key,
                               value=self.spec) from None
    scaled = tuple(self.scale(tf.zeros((1, *shape), tf.uint8)).shape[1:])
    if scaled != shape:
      raise errors.ConfigError(
          f'config.{self.key}={self.spec!r} scales {channels}-channel images into {scaled[-1]}'
          f'-channel ones: give its normalize or value_range one value per channel.',
          key=self.key, value=self.spec)
    if augmented != shape:
      raise errors.ConfigError(
          f'config.{self.key}={self.spec!r} turns {shape[0]}x{shape[1]} images into '
          f'{augmented[0]}x{augmented[1]} ones in its random ops, but training and eval images '
          f'must have one size: crop to {shape[0]}, or resize first.',
          key=self.key, value=self.spec)
    return shape


def _output_shape(ops: ImageOp, source_shape: tuple[int | None, int | None, int]
                  ) -> tuple[int | None, int | None, int]:
  """The shape `ops` give one image of `source_shape` (height, width None: varying); a
  dimension is None where the output follows the input's varying size."""
  height, width, channels = source_shape
  probes = _PROBE_SIZES if None in (height, width) else _PROBE_SIZES[:1]
  shapes = [ops(tf.zeros((height or probe[0], width or probe[1], channels), tf.uint8)).shape
            for probe in probes]
  return tuple(sizes.pop() if len(sizes) == 1 else None for sizes in map(set, zip(*shapes)))


def parse(spec: str, key: str = _KEY) -> Preprocessing:
  """The `Preprocessing` of `spec`, the value of config.`key`; a `ConfigError` naming the op at
  fault and the valid ones."""
  ops = {stage: [] for stage in STAGES}
  last_stage = 0
  keeps_uint8 = True
  resize_specs = []
  for text, entry, op in OPS.create_calls(spec, key):
    stage = STAGES.index(entry.capabilities['stage'])
    if stage < last_stage or (stage == last_stage and STAGES[stage] in _ONE_OP_STAGES):
      raise errors.ConfigError(
          f'config.{key}={spec!r} is invalid: {text!r} comes too late (resize ops come '
          'first, then at most one per-image crop op (random_resized_crop), then random ops, '
          'then at most one scale op: normalize, value_range or standardize).', key=key,
          value=spec)
    last_stage = stage
    ops[STAGES[stage]].append(op)
    if STAGES[stage] in ('image', 'crop'):
      resize_specs.append(text if STAGES[stage] == 'image' else op.eval_spec)
    if STAGES[stage] == 'random':
      keeps_uint8 &= entry.capabilities.get('uint8', False)
  return Preprocessing(spec, key, image_ops=tuple(ops['image']),
                       crop_op=ops['crop'][0] if ops['crop'] else None,
                       random_ops=tuple(ops['random']),
                       scale_op=ops['scale'][0] if ops['scale'] else None,
                       keeps_uint8=keeps_uint8, resize_spec='|'.join(resize_specs))


# The ops' argument checks, each raising the ValueError that the registry reports as a
# `ConfigError` naming the op.


def _is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int) -> None:
  """Raises ValueError unless `value` is an integer >= `minimum`."""
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ValueError(f'{name}={value!r} must be an integer >= {minimum}')


def check_number(name: str, value, low: float, high: float, *, low_open: bool = False) -> float:
  """`value` as a float; ValueError unless it is a number in [low, high] ((low, high] when
  `low_open`)."""
  if not _is_number(value) or not (low < value if low_open else low <= value) or value > high:
    raise ValueError(f'{name}={value!r} must be a number in {"(" if low_open else "["}{low:g}, '
                     f'{high:g}]')
  return float(value)


def check_numbers(name: str, values) -> tuple[float, ...]:
  """`values` (a number, or a tuple of numbers: one per channel) as a tuple."""
  values = tuple(values) if isinstance(values, (tuple, list)) else (values,)
  if not values or not all(_is_number(value) for value in values):
    raise ValueError(f'{name}={values!r} must be a number or a tuple of numbers (one per channel)')
  return values


def check_interval(name: str, value, high: float = math.inf) -> tuple[float, float]:
  """`value` as a pair (a, b) with 0 < a <= b <= high: a range to draw from."""
  if (not isinstance(value, (tuple, list)) or len(value) != 2
      or not all(_is_number(end) for end in value) or not 0 < value[0] <= value[1] <= high):
    bound = '' if high == math.inf else f' <= {high:g}'
    raise ValueError(f'{name}={value!r} must be a pair (a, b) with 0 < a <= b{bound}')
  return float(value[0]), float(value[1])
