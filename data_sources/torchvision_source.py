"""torchvision datasets with 'train' and 'test' splits, such as MNIST (optional install)."""

import os

from core import errors
import data_sources
from data_sources import base


@data_sources.SOURCES.register('torchvision', requires='torchvision')
def open_torchvision(name: str, data_dir: str | None, download: bool = False) -> base.RangeSource:
  """`torchvision.datasets.<name>(data_dir, train=..., download=download)`: 'train' and 'test'.

  `download` (config.data_source_options.torchvision.download) fetches a missing dataset.
  """
  import torchvision  # pylint: disable=g-import-not-at-top  (optional)
  if name not in torchvision.datasets.__all__:
    raise errors.ConfigError(
        f'Unknown torchvision dataset {name!r}: config.dataset must be a torchvision.datasets '
        "class such as 'MNIST', 'FashionMNIST' or 'CIFAR10'.", key='dataset', value=name)
  if data_dir is None:
    raise errors.ConfigError(
        "config.data_source='torchvision' needs config.data_dir: the root that holds the data "
        '(for MNIST: ROOT/MNIST/raw/).', key='data_dir', value=None)
  dataset_class = getattr(torchvision.datasets, name)
  datasets = {}
  for split, train in (('train', True), ('test', False)):
    try:
      datasets[split] = dataset_class(data_dir, train=train, download=download)
    except RuntimeError as error:  # torchvision's "Dataset not found".
      raise errors.DataError(
          f'torchvision {name} {split} split not found under root {data_dir!r} '
          f'(config.data_dir). For MNIST-style datasets put the gunzipped raw files '
          f'(train-images-idx3-ubyte, t10k-labels-idx1-ubyte, ...) in '
          f'{os.path.join(data_dir, name, "raw")}/, or set '
          'config.data_source_options.torchvision.download=True to download them. '
          f'(torchvision said: {error})', what=os.path.join(data_dir, name)) from error

  def load_range(split: str, part: slice) -> base.Split:
    return base.to_split(datasets[split].data[part], datasets[split].targets[part])

  return base.RangeSource(name, {split: len(dataset) for split, dataset in datasets.items()},
                          len(datasets['train'].classes), load_range,
                          class_names=datasets['train'].classes)
