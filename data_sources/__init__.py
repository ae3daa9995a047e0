"""Data sources: TFDS, image folders, Hugging Face `datasets` or torchvision, behind one interface.

`open_source(config)` returns a `base.DataSource` for `config.data_source`: its metadata (image
shape, class names, split sizes) comes first and cheaply, so that config values can be checked
against it, then `load_split` decodes a split into memory as uint8 images and int32 labels, or
(TFDS and folders) `examples` streams it from its files; `input_pipeline` resizes, normalises,
shuffles, augments and batches. Hugging Face, torchvision and the torch DataLoader backend
(`torch_loader`) are optional installs (requirements-extras.txt), imported only when selected.

To add a source: subclass `base.DataSource` (or build a `base.RangeSource`) in a module here,
and add its constructor to `SOURCES`.
"""

from collections.abc import Callable
import dataclasses
import json
import os

import ml_collections

from data_sources import base
from data_sources import folder_source
from data_sources import huggingface_source
from data_sources import tfds_source
from data_sources import torchvision_source

SOURCES: dict[str, Callable[[ml_collections.ConfigDict], base.DataSource]] = {
    'tfds': lambda config: tfds_source.TfdsSource(config.dataset, config.data_dir),
    'folder': lambda config: folder_source.FolderSource(config.dataset),
    'huggingface': huggingface_source.open_huggingface,
    'torchvision': torchvision_source.open_torchvision,
}
# The sources that can stream a split from its files (config.in_memory='never').
STREAMING_SOURCES = ('tfds', 'folder')
INPUT_BACKENDS = ('tf', 'torch')
# In a workdir, the metadata of the data that its checkpoints were trained on: predict and
# export read the class names and image shape from it, without the data.
INFO_FILE = 'dataset_info.json'
# The optional package (import name = pip name) that a data source or input backend needs.
OPTIONAL_PACKAGES = {'huggingface': 'datasets', 'torchvision': 'torchvision', 'torch': 'torch'}


def open_source(config: ml_collections.ConfigDict) -> base.DataSource:
  """The data source of `config.dataset`, as `config.data_source` names it."""
  return SOURCES[config.data_source](config)


def save_info(workdir: str, info: base.DatasetInfo) -> None:
  """Writes `info` to <workdir>/INFO_FILE (atomically: a reader sees the old or the new file)."""
  path = os.path.join(workdir, INFO_FILE)
  with open(path + '.tmp', 'w', encoding='utf-8') as file:
    json.dump(dataclasses.asdict(info), file, indent=2)
  os.replace(path + '.tmp', path)


def workdir_info(config: ml_collections.ConfigDict, workdir: str) -> base.DatasetInfo:
  """The info saved in `workdir` by training, or else (an older workdir) the data source's."""
  path = os.path.join(workdir, INFO_FILE)
  if not os.path.exists(path):
    return open_source(config).info(config)
  with open(path, encoding='utf-8') as file:
    saved = json.load(file)
  return base.DatasetInfo(**{**saved, 'image_shape': tuple(saved['image_shape']),
                             'class_names': tuple(saved['class_names'])})
