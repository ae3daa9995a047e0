"""The interface every data source implements: a dataset's metadata and its splits in memory.

A source answers, cheaply, what the model and the config checks need (image shape, class count,
split sizes), and decodes a split into a `Split` only when asked. Split names use TFDS's syntax
for every source ('train', 'train[:2560]', 'train[:90%]+test').
"""

import abc
from collections.abc import Callable
import dataclasses

from absl import logging
import ml_collections
import numpy as np
import tensorflow_datasets as tfds


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


class DataSource(abc.ABC):
  """An image-classification dataset: metadata first, then splits decoded on request."""

  def __init__(self, name: str):
    self.name = name

  @property
  @abc.abstractmethod
  def image_shape(self) -> tuple[int, int, int]:
    """(height, width, channels) of every image."""

  @property
  @abc.abstractmethod
  def num_classes(self) -> int:
    """Labels are integers in [0, num_classes)."""

  @abc.abstractmethod
  def num_examples(self, split: str) -> int:
    """The number of examples of a split spec such as 'train[:90%]'."""

  @abc.abstractmethod
  def load_split(self, split: tfds.typing.SplitArg) -> Split:
    """Decodes a split into memory, in the source's order."""

  def info(self, config: ml_collections.ConfigDict) -> DatasetInfo:
    """The metadata of the config's training and eval splits."""
    return DatasetInfo(name=self.name, image_shape=tuple(self.image_shape),
                       num_classes=self.num_classes,
                       num_train_examples=self.num_examples(config.train_split),
                       num_eval_examples=self.num_examples(config.eval_split))


class RangeSource(DataSource):
  """A source whose named splits can each be read by index range (Hugging Face, torchvision).

  TFDS's split syntax is resolved here, on the split sizes, into (split name, slice) reads.
  """

  def __init__(self, name: str, sizes: dict[str, int], num_classes: int,
               load_range: Callable[[str, slice], Split]):
    super().__init__(name)
    self._sizes = sizes
    self._num_classes = num_classes
    self._load_range = load_range

  @property
  def image_shape(self) -> tuple[int, int, int]:
    first = next(iter(self._sizes))
    return self._load_range(first, slice(0, 1)).images.shape[1:]

  @property
  def num_classes(self) -> int:
    return self._num_classes

  def _ranges(self, spec: str) -> list[tuple[str, slice]]:
    """The (split, slice) pairs that a TFDS split spec such as 'train[:90%]+test' names."""
    infos = {name: tfds.core.SplitInfo(name=name, shard_lengths=[size], num_bytes=0)
             for name, size in self._sizes.items()}
    return [(part.splitname, slice(part.from_, part.to))
            for part in tfds.core.ReadInstruction.from_spec(spec).to_absolute(infos)]

  def num_examples(self, split: str) -> int:
    return sum(len(range(self._sizes[name])[part]) for name, part in self._ranges(split))

  def load_split(self, split: str) -> Split:
    logging.info('Loading split %r of %s into memory.', split, self.name)
    parts = [self._load_range(name, part) for name, part in self._ranges(split)]
    return Split(images=np.concatenate([part.images for part in parts]),
                 labels=np.concatenate([part.labels for part in parts]))


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
