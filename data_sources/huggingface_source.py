"""Hugging Face `datasets`: a Hub name or a local dataset directory (optional install)."""

import os

import ml_collections

from data_sources import base


def open_huggingface(config: ml_collections.ConfigDict) -> base.RangeSource:
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
    raise base.DataError(
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

  def load_range(name: str, part: slice) -> base.Split:
    examples = dataset_dict[name].select(range(len(dataset_dict[name]))[part])
    return base.to_split(examples[image_key], examples[label_key])

  return base.RangeSource(config.dataset,
                          {name: len(split) for name, split in dataset_dict.items()},
                          features[label_key].num_classes, load_range,
                          class_names=features[label_key].names)
