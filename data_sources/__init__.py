"""Data sources: TFDS, Hugging Face `datasets` or torchvision, all behind one interface.

`open_source(config)` returns a `base.DataSource` for `config.data_source`: its metadata (image
shape, classes, split sizes) comes first and cheaply, so that config values can be checked
against it, then `load_split` decodes a split into memory as uint8 images and int32 labels,
which `input_pipeline` normalises, shuffles and batches. Hugging Face, torchvision and the torch
DataLoader backend (`torch_loader`) are optional installs (requirements-extras.txt), imported
only when selected.

To add a source: subclass `base.DataSource` (or build a `base.RangeSource`) in a module here,
and add its constructor to `SOURCES`.
"""

from collections.abc import Callable

import ml_collections

from data_sources import base
from data_sources import huggingface_source
from data_sources import tfds_source
from data_sources import torchvision_source

SOURCES: dict[str, Callable[[ml_collections.ConfigDict], base.DataSource]] = {
    'tfds': lambda config: tfds_source.TfdsSource(config.dataset, config.data_dir),
    'huggingface': huggingface_source.open_huggingface,
    'torchvision': torchvision_source.open_torchvision,
}
INPUT_BACKENDS = ('tf', 'torch')
# The optional package (import name = pip name) that a data source or input backend needs.
OPTIONAL_PACKAGES = {'huggingface': 'datasets', 'torchvision': 'torchvision', 'torch': 'torch'}


def open_source(config: ml_collections.ConfigDict) -> base.DataSource:
  """The data source of `config.dataset`, as `config.data_source` names it."""
  return SOURCES[config.data_source](config)
