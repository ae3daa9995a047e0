"""torchvision datasets with 'train' and 'test' splits, such as MNIST (optional install)."""

import os

import ml_collections

from data_sources import base


def open_torchvision(config: ml_collections.ConfigDict) -> base.RangeSource:
  """`torchvision.datasets.<config.dataset>(config.data_dir, train=...)`: 'train' and 'test'."""
  import torchvision  # pylint: disable=g-import-not-at-top  (optional)
  dataset_class = getattr(torchvision.datasets, config.dataset)
  datasets = {}
  for name, train in (('train', True), ('test', False)):
    try:
      datasets[name] = dataset_class(config.data_dir, train=train, download=config.download)
    except RuntimeError as error:  # torchvision's "Dataset not found".
      raise base.DataError(
          f'torchvision {config.dataset} {name} split not found under root {config.data_dir!r} '
          f'(config.data_dir). For MNIST-style datasets put the gunzipped raw files '
          f'(train-images-idx3-ubyte, t10k-labels-idx1-ubyte, ...) in '
          f'{os.path.join(config.data_dir, config.dataset, "raw")}/, or set '
          f'config.download=True to download them. (torchvision said: {error})') from error

  def load_range(name: str, part: slice) -> base.Split:
    return base.to_split(datasets[name].data[part], datasets[name].targets[part])

  return base.RangeSource(config.dataset,
                          {name: len(dataset) for name, dataset in datasets.items()},
                          len(datasets['train'].classes), load_range,
                          class_names=datasets['train'].classes)
