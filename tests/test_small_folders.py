"""The generated folders of benchmarks/small_folders.py: what the folder source reads of them."""

import logging

import numpy as np
import pytest

from data_sources import folder_source
import image_folders


@pytest.mark.parametrize('kind', list(image_folders.KINDS))
def test_a_generated_folder_reads_as_its_classes_with_the_messy_files_skipped(tmp_path, caplog,
                                                                              kind):
  root = str(tmp_path / kind)
  names = image_folders.KINDS[kind][0]
  written = image_folders.make_kind_folder(root, kind, num_images=8 * len(names))
  with caplog.at_level(logging.WARNING):
    source = folder_source.FolderSource(root)
  assert source.class_names == names
  assert source.num_examples('train') == written == 8 * len(names)
  assert f'Skipped {3 * len(names)} files' in caplog.text  # Each class's 3 unreadable files.
  images = [example['image'] for example in source.examples('train').as_numpy_iterator()]
  assert {image.shape[2] for image in images} == {3}  # Colour, the grayscale ones converted.
  sizes = np.array([image.shape[:2] for image in images])
  assert sizes.min() >= 40 and sizes.max() <= 80 and len(np.unique(sizes, axis=0)) > 1


def test_the_same_seed_writes_the_same_folder_and_another_seed_another(tmp_path):
  read = lambda root: [example['image'] for example in
                       folder_source.FolderSource(root).examples('train').as_numpy_iterator()]
  for name, seed in (('a', 0), ('b', 0), ('c', 1)):
    image_folders.make_kind_folder(str(tmp_path / name), 'textures', seed=seed, num_images=8,
                                   messy=False)
  first, again, other = (read(str(tmp_path / name)) for name in 'abc')
  assert all(np.array_equal(x, y) for x, y in zip(first, again))
  assert not all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(first, other))
