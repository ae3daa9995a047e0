"""Data sources: TFDS, Hugging Face `datasets` or torchvision, all loaded into the same `Split`.

Whatever the source, a split ends up in memory as uint8 images (N, H, W, C) and int32 labels
(`to_split`, the one conversion shared by the non-TFDS sources), which `input_pipeline` then
normalises, shuffles and batches. Split names use TFDS's syntax for every source ('train',
'train[:2560]', 'train[:90%]+test'). Hugging Face and torchvision are optional installs
(requirements-extras.txt), imported only when selected.
"""

from collections.abc import Callable, Iterator
import dataclasses
import functools
import os

from absl import logging
import ml_collections
import numpy as np
import tensorflow_datasets as tfds

import input_pipeline

SOURCES = ('tfds', 'huggingface', 'torchvision')
INPUT_BACKENDS = ('tf', 'torch')
# The optional package (import name = pip name) that a data source or input backend needs.
OPTIONAL_PACKAGES = {'huggingface': 'datasets', 'torchvision': 'torchvision', 'torch': 'torch'}

LoadSplit = Callable[[str], input_pipeline.Split]


def open_source(config: ml_collections.ConfigDict) -> tuple[input_pipeline.DatasetInfo, LoadSplit]:
  """The metadata of `config.dataset` from `config.data_source`, and a loader of its splits.

  The metadata comes first, and cheaply, so that config values can be checked against it before
  the splits are decoded: `load_split(config.train_split)` does the decoding.
  """
  if config.data_source == 'tfds':
    builder = input_pipeline.prepared_builder(config)
    return (input_pipeline.get_info(builder, config),
            functools.partial(input_pipeline.load_split, builder))
  source = {'huggingface': _huggingface, 'torchvision': _torchvision}[config.data_source](config)
  return source.info(config), source.load_split


def train_batches(split: input_pipeline.Split, config: ml_collections.ConfigDict,
                  start_epoch: int = 0, start_step: int = 0) -> Iterator[input_pipeline.Batch]:
  """Training chunks from `config.input_backend`: tf.data, or a torch DataLoader."""
  if config.input_backend == 'torch':
    import torch_pipeline  # pylint: disable=g-import-not-at-top  (torch is optional)
    return torch_pipeline.train_batches(split, config, start_epoch, start_step)
  return input_pipeline.train_batches(split, config, start_epoch, start_step)


def to_split(images, labels) -> input_pipeline.Split:
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
  return input_pipeline.Split(images=images, labels=np.asarray(labels).astype(np.int32))


@dataclasses.dataclass(frozen=True)
class _Source:
  """A non-TFDS dataset: its split sizes, class count and a loader of ranges of a split."""
  sizes: dict[str, int]
  num_classes: int
  load_range: Callable[[str, slice], input_pipeline.Split]

  def ranges(self, spec: str) -> list[tuple[str, slice]]:
    """The (split, slice) pairs that a TFDS split spec such as 'train[:90%]+test' names."""
    infos = {name: tfds.core.SplitInfo(name=name, shard_lengths=[size], num_bytes=0)
             for name, size in self.sizes.items()}
    return [(part.splitname, slice(part.from_, part.to))
            for part in tfds.core.ReadInstruction.from_spec(spec).to_absolute(infos)]

  def num_examples(self, spec: str) -> int:
    return sum(len(range(self.sizes[name])[part]) for name, part in self.ranges(spec))

  def info(self, config: ml_collections.ConfigDict) -> input_pipeline.DatasetInfo:
    name, _ = self.ranges(config.train_split)[0]
    return input_pipeline.DatasetInfo(
        name=config.dataset,
        image_shape=self.load_range(name, slice(0, 1)).images.shape[1:],
        num_classes=self.num_classes,
        num_train_examples=self.num_examples(config.train_split),
        num_eval_examples=self.num_examples(config.eval_split),
    )

  def load_split(self, spec: str) -> input_pipeline.Split:
    logging.info('Loading split %r into memory.', spec)
    parts = [self.load_range(name, part) for name, part in self.ranges(spec)]
    return input_pipeline.Split(images=np.concatenate([part.images for part in parts]),
                                labels=np.concatenate([part.labels for part in parts]))


def _torchvision(config: ml_collections.ConfigDict) -> _Source:
  """`torchvision.datasets.<config.dataset>(config.data_dir, train=...)`: 'train' and 'test'."""
  import torchvision  # pylint: disable=g-import-not-at-top  (optional)
  dataset_class = getattr(torchvision.datasets, config.dataset)
  datasets = {}
  for name, train in (('train', True), ('test', False)):
    try:
      datasets[name] = dataset_class(config.data_dir, train=train, download=config.download)
    except RuntimeError as error:  # torchvision's "Dataset not found".
      raise RuntimeError(
          f'torchvision {config.dataset} {name} split not found under root {config.data_dir!r} '
          f'(config.data_dir). For MNIST-style datasets put the gunzipped raw files '
          f'(train-images-idx3-ubyte, t10k-labels-idx1-ubyte, ...) in '
          f'{os.path.join(config.data_dir, config.dataset, "raw")}/, or set '
          f'config.download=True to download them. (torchvision said: {error})') from error

  def load_range(name: str, part: slice) -> input_pipeline.Split:
    return to_split(datasets[name].data[part], datasets[name].targets[part])

  return _Source(sizes={name: len(dataset) for name, dataset in datasets.items()},
                 num_classes=len(datasets['train'].classes), load_range=load_range)


def _huggingface(config: ml_collections.ConfigDict) -> _Source:
  """`datasets.load_dataset(config.dataset)`, or `load_from_disk` for a saved local DatasetDict.

  The images come from the dataset's `datasets.Image` feature and the labels from its
  `datasets.ClassLabel` feature, whatever the columns are called.
  """
  import datasets  # pylint: disable=g-import-not-at-top  (optional)
  try:
    if os.path.isfile(os.path.join(config.dataset, datasets.config.DATASETDICT_JSON_FILENAME)):
      dataset_dict = datasets.load_from_disk(config.dataset)
    else:
      dataset_dict = datasets.load_dataset(config.dataset, cache_dir=config.data_dir)
  except Exception as error:  # Hub, network and file errors all mean "not found" here.
    cache_dir = config.data_dir or datasets.config.HF_DATASETS_CACHE
    raise RuntimeError(
        f'Hugging Face dataset {config.dataset!r} could not be loaded: looked for a local '
        f'directory {os.path.abspath(config.dataset)!r}, the cache dir {str(cache_dir)!r} '
        '(config.data_dir) and the Hub. Offline, set config.dataset to a directory saved with '
        f'DatasetDict.save_to_disk or holding the data files. (datasets said: {error})') from error

  features = next(iter(dataset_dict.values())).features
  image_key = next((key for key, feature in features.items()
                    if isinstance(feature, datasets.Image)), None)
  label_key = next((key for key, feature in features.items()
                    if isinstance(feature, datasets.ClassLabel)), None)
  if image_key is None or label_key is None:
    raise ValueError(f'Hugging Face dataset {config.dataset!r} has features {features}; an '
                     'Image feature and a ClassLabel feature are needed.')

  def load_range(name: str, part: slice) -> input_pipeline.Split:
    examples = dataset_dict[name].select(range(len(dataset_dict[name]))[part])
    return to_split(examples[image_key], examples[label_key])

  return _Source(sizes={name: len(split) for name, split in dataset_dict.items()},
                 num_classes=features[label_key].num_classes, load_range=load_range)
