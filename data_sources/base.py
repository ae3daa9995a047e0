"""The interface every data source implements: a dataset's metadata and its splits.

A source answers, cheaply, what the model and the config checks need (image shape, class names,
split sizes), and decodes a split only when asked: into memory as a `Split`, or, for sources
that can, streamed from its files as a tf.data pipeline (`examples`). Split names use TFDS's
syntax for every source ('train', 'train[:2560]', 'train[:90%]+test').
"""

import abc
from collections.abc import Callable, Sequence
import dataclasses

from absl import logging
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from core import errors

SplitArg = tfds.typing.SplitArg  # A split spec such as 'train[:90%]', or one process's slice.
_MATERIALIZE_BLOCK = 1024  # Examples per tf.data batch when a streamed split is read into memory.

@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """What the model and the train loop need to know about the data."""
  name: str
  image_shape: tuple[int, int, int]  # (height, width, channels) as the model sees them.
  num_classes: int
  num_train_examples: int
  num_eval_examples: int
  class_names: tuple[str, ...] = ()  # Label i is class_names[i]; () = unnamed.
  num_test_examples: int = 0  # Of config.test_split; 0 when it is not set.


@dataclasses.dataclass(frozen=True)
class Split:
  """A whole split in memory: uint8 images (N, H, W, C) and int32 labels (N,)."""
  images: np.ndarray
  labels: np.ndarray


class DataSource(abc.ABC):
  """An image-classification dataset: metadata first, then splits decoded on request.

  `SHUFFLES_EXAMPLES`: whether `examples` with a seed comes in an order drawn from the whole
  split (a perfect shuffle), not only its files' or shards' order.
  """
  SHUFFLES_EXAMPLES = False

  def __init__(self, name: str):
    self.name = name

  @property
  @abc.abstractmethod
  def image_shape(self) -> tuple[int | None, int | None, int]:
    """(height, width, channels) of every image; height and width are None if they vary."""

  @property
  @abc.abstractmethod
  def num_classes(self) -> int:
    """Labels are integers in [0, num_classes)."""

  @abc.abstractmethod
  def num_examples(self, split: str) -> int:
    """The number of examples of a split spec such as 'train[:90%]'."""

  @property
  def class_names(self) -> tuple[str, ...]:
    """The name of each label; the label numbers unless the source knows names."""
    return tuple(str(label) for label in range(self.num_classes))

  @abc.abstractmethod
  def load_split(self, split: SplitArg) -> Split:
    """Decodes a split into memory, in the source's order (its images must have one size)."""

  def examples(self, split: SplitArg, shuffle_seed: int | None = None) -> tf.data.Dataset:
    """The split streamed from its files, never whole in memory, for sources that can.

    Examples are {'image': uint8 (height, width, channels), 'label': int32}, decoded in parallel,
    in a deterministic order: the source's order, or with `shuffle_seed` its files (or file
    shards) in an order drawn from that seed.
    """
    raise NotImplementedError(f'{type(self).__name__} reads splits into memory only.')

  def windowed_examples(self, split: SplitArg, shuffle_seed: int,
                        window: Callable[[tf.Tensor, tf.Tensor], tf.Tensor]) -> tf.data.Dataset:
    """`examples` with each image cut to `window(size, index)`: the window [top, left, height,
    width] of an image of `size` (height, width) at `index` in the order of `shuffle_seed`.
    Cut here from the decoded image; a source that can decode only the window does."""
    def cut(index: tf.Tensor, example: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
      top, left, height, width = tf.unstack(window(tf.shape(example['image'])[:2], index))
      return {**example, 'image': tf.slice(example['image'], [top, left, 0],
                                           [height, width, -1])}
    return self.examples(split, shuffle_seed).enumerate().map(
        cut, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

  def split_size(self, key: str, split: str) -> int:
    """The number of examples of `split`, the value of config.`key`; a `ConfigError` naming
    the key if it is not a split of this source or selects nothing."""
    try:
      size = self.num_examples(split)
    except (KeyError, ValueError) as error:  # TFDS's messages name the valid splits.
      raise errors.ConfigError(f'config.{key}={split!r} is not a split of {self.name}: '
                               f'{" ".join(str(error).split())}', key=key, value=split) from error
    if not size:
      raise errors.ConfigError(f'config.{key}={split!r} selects no examples of {self.name}: '
                               'widen the slice, e.g. "train[:90%]".', key=key, value=split)
    return size


class RangeSource(DataSource):
  """A source whose named splits can each be read by index range (Hugging Face, torchvision).

  TFDS's split syntax is resolved here, on the split sizes, into (split name, slice) reads.
  """

  def __init__(self, name: str, sizes: dict[str, int], num_classes: int,
               load_range: Callable[[str, slice], Split],
               class_names: Sequence[str] | None = None):
    super().__init__(name)
    self._sizes = sizes
    self._num_classes = num_classes
    self._load_range = load_range
    self._class_names = tuple(class_names) if class_names is not None else None

  @property
  def image_shape(self) -> tuple[int, int, int]:
    first = next(iter(self._sizes))
    return self._load_range(first, slice(0, 1)).images.shape[1:]

  @property
  def num_classes(self) -> int:
    return self._num_classes

  @property
  def class_names(self) -> tuple[str, ...]:
    return self._class_names or super().class_names

  def _ranges(self, spec: SplitArg) -> list[tuple[str, slice]]:
    """The (split, slice) pairs that a TFDS split spec such as 'train[:90%]+test' names."""
    infos = {name: tfds.core.SplitInfo(name=name, shard_lengths=[size], num_bytes=0)
             for name, size in self._sizes.items()}
    if isinstance(spec, str):
      spec = tfds.core.ReadInstruction.from_spec(spec)
    return [(part.splitname, slice(part.from_, part.to)) for part in spec.to_absolute(infos)]

  def num_examples(self, split: str) -> int:
    return sum(len(range(self._sizes[name])[part]) for name, part in self._ranges(split))

  def load_split(self, split: str) -> Split:
    logging.info('Loading split %r of %s into memory.', split, self.name)
    parts = [self._load_range(name, part) for name, part in self._ranges(split)]
    return Split(images=np.concatenate([part.images for part in parts]),
                 labels=np.concatenate([part.labels for part in parts]))


def materialize(examples: tf.data.Dataset) -> Split:
  """Reads examples of one image size ({'image', 'label'}, as `examples` yields) into memory."""
  blocks = list(examples.batch(_MATERIALIZE_BLOCK).prefetch(1).as_numpy_iterator())
  return Split(images=np.concatenate([block['image'] for block in blocks]),
               labels=np.concatenate([block['label'] for block in blocks]).astype(np.int32))


def to_split(images, labels) -> Split:
  """Converts images and labels from any library into a `Split`.

  Args:
    images: an array or tensor (N, H, W) or (N, H, W, C), or a sequence of PIL images. Grayscale
      images get a trailing channel axis.
    labels: N integer class ids (array, tensor or list).
  """
  if not hasattr(images, 'shape'):  # PIL images: converted one by one.
    images = np.stack([np.asarray(image) for image in images])
  images = np.asarray(images)
  if images.ndim == 3:
    images = images[..., np.newaxis]
  if images.dtype != np.uint8 or images.ndim != 4:
    raise ValueError(f'Images must be uint8 (N, H, W[, C]) arrays with values in [0, 255]; got '
                     f'{images.dtype} {images.shape}.')
  return Split(images=images, labels=np.asarray(labels).astype(np.int32))
