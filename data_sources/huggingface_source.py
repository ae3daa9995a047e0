"""Hugging Face `datasets`: a Hub name or a local dataset directory (optional install)."""

import os

from core import errors
import data_sources
from data_sources import base


@data_sources.SOURCES.register('huggingface', requires='datasets')
def open_huggingface(name: str, data_dir: str | None) -> base.RangeSource:
  """`datasets.load_dataset(name, cache_dir=data_dir)`, or `load_from_disk` for a saved local
  DatasetDict.

  The images come from the dataset's `datasets.Image` feature and the labels from its
  `datasets.ClassLabel` feature, whatever the columns are called.
  """
  import datasets  # pylint: disable=g-import-not-at-top  (optional)
  from datasets import config as library_settings  # pylint: disable=g-import-not-at-top
  try:
    if os.path.isfile(os.path.join(name, library_settings.DATASETDICT_JSON_FILENAME)):
      dataset_dict = datasets.load_from_disk(name)
    else:
      dataset_dict = datasets.load_dataset(name, cache_dir=data_dir)
  except Exception as error:  # Hub, network and file errors all mean "not found" here.
    cache_dir = data_dir or library_settings.HF_DATASETS_CACHE
    raise errors.DataError(
        f'Hugging Face dataset {name!r} could not be loaded: looked for a local directory '
        f'{os.path.abspath(name)!r}, the cache dir {str(cache_dir)!r} (config.data_dir) and the '
        'Hub. Offline, set config.dataset to a directory saved with DatasetDict.save_to_disk or '
        f'holding the data files. (datasets said: {error})', what=name) from error

  features = next(iter(dataset_dict.values())).features
  image_key = next((key for key, feature in features.items()
                    if isinstance(feature, datasets.Image)), None)
  label_key = next((key for key, feature in features.items()
                    if isinstance(feature, datasets.ClassLabel)), None)
  if image_key is None or label_key is None:
    raise errors.DataError(f'Hugging Face dataset {name!r} has features {features}; an Image '
                           'feature and a ClassLabel feature are needed.', what=name)

  def load_range(split: str, part: slice) -> base.Split:
    examples = dataset_dict[split].select(range(len(dataset_dict[split]))[part])
    return base.to_split(examples[image_key], examples[label_key])

  return base.RangeSource(name, {split: len(examples) for split, examples in dataset_dict.items()},
                          features[label_key].num_classes, load_range,
                          class_names=features[label_key].names)
