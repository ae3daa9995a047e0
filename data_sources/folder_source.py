"""Image folders: `root/<split>/<class name>/.../<image file>`, the layout of Keras, torchvision,
Hugging Face and TFDS's `ImageFolder`.

Splits are the root's subfolders and take TFDS's split syntax ('train[:90%]+test'). Class names
are the class folders' names, sorted; they are the union over all splits, so a label means the
same class in every split. A class folder is read recursively: images in its subfolders belong
to it. Images are read with the image-file library (`image_files`): JPEG, PNG, BMP or GIF of any
sizes, as an image viewer shows them, their headers first (kept in an index) so that unreadable
files are skipped with one warning before anything is decoded. An image has 1 channel when every
image of the dataset is grayscale, otherwise 3 (grayscale images are converted). Within a split,
files are ordered by a hash of their path: stable across runs and machines, and mixed across
classes, so that a slice such as 'train[:90%]' holds every class (TFDS orders its examples the
same way).

Hand-written rather than `tfds.folder_dataset.ImageFolder`, which reads only .jpg/.jpeg/.png
files, fails on the first unreadable file, shuffles without a seed, ignores EXIF orientation
and needs the channel count given up front.
"""

import collections
from collections.abc import Callable
import hashlib
import os

from absl import logging
import tensorflow as tf

from core import errors
import data_sources
from data_sources import base
from data_sources import image_files


def _visible_entries(folder: str) -> list[str]:
  """The entries of `folder`, sorted, without hidden ones (.DS_Store, ._* and the like)."""
  return sorted(entry for entry in os.listdir(folder) if not entry.startswith('.'))


class ImageFilesSource(base.RangeSource):
  """Image files with their labels, by split: decoded as `image_files.decode` does, in memory
  or streamed.

  Within a split, files are ordered by a hash of their path relative to `root`: stable across
  runs and machines, and mixed across classes. Streamed with a seed, the file names are
  shuffled (all of them: a perfect shuffle that holds no pixels) before decoding.
  """
  SHUFFLES_EXAMPLES = True

  def __init__(self, name: str, root: str, files: dict[str, list[tuple[str, int]]],
               headers: list[image_files.ImageHeader], class_names: list[str]):
    self._headers = {header.path: header for header in headers}
    self._files = files  # split -> [(path, label)]
    prefix = os.path.join(root, '')
    # relpath(path, root) without its cost (10x the hash's) where `path` is normalized and under
    # `root`, as a folder's files are: the same result.
    relative = lambda path: (path[len(prefix):] if path.startswith(prefix)
                             and os.path.normpath(path) == path else os.path.relpath(path, root))
    for split_files in files.values():
      split_files.sort(key=lambda file: hashlib.md5(relative(file[0]).encode()).digest())
    self._channels = 1 if all(header.gray for header in headers) else 3
    sizes = {header.size for header in headers}
    self._size = sizes.pop() if len(sizes) == 1 else (None, None)
    super().__init__(name, {split: len(split_files) for split, split_files in files.items()},
                     len(class_names), self._load_range, class_names)

  @property
  def image_shape(self) -> tuple[int | None, int | None, int]:
    return (*self._size, self._channels)

  def class_counts(self, split: base.SplitArg) -> collections.Counter:
    """The number of images of each label in `split`."""
    return collections.Counter(label for name, part in self._ranges(split)
                               for _, label in self._files[name][part])

  def examples(self, split: base.SplitArg, shuffle_seed: int | None = None) -> tf.data.Dataset:
    return self._decoded(self._split_files(split), shuffle_seed)

  def windowed_examples(self, split: base.SplitArg, shuffle_seed: int,
                        window: Callable[[tf.Tensor, tf.Tensor], tf.Tensor]) -> tf.data.Dataset:
    """`examples` cut to their windows as they are decoded: each window is drawn from the
    image's size in its header, and only the window of a JPEG is decoded."""
    return self._files_dataset(self._split_files(split), shuffle_seed).enumerate().map(
        lambda index, file: {
            'image': image_files.decode_window(
                file['path'], self._channels, window(file['size'], index),
                file['orientation'], file['alpha']),
            'label': tf.cast(file['label'], tf.int32)},
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

  def _split_files(self, split: base.SplitArg) -> list[tuple[str, int]]:
    return [file for name, part in self._ranges(split) for file in self._files[name][part]]

  def _load_range(self, name: str, part: slice) -> base.Split:
    return base.materialize(self._decoded(self._files[name][part]))

  def _decoded(self, files: list[tuple[str, int]],
               shuffle_seed: int | None = None) -> tf.data.Dataset:
    """The images of `files`, decoded in parallel, in order (or shuffled by `shuffle_seed`)."""
    return self._files_dataset(files, shuffle_seed).map(
        lambda file: {
            'image': image_files.decode(file['path'], self._channels, file['orientation'],
                                        file['alpha']),
            'label': tf.cast(file['label'], tf.int32)},
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

  def _files_dataset(self, files: list[tuple[str, int]],
                     shuffle_seed: int | None) -> tf.data.Dataset:
    """`files` with what their headers say, in order (or shuffled by `shuffle_seed`)."""
    paths, labels = zip(*files)
    headers = [self._headers[path] for path in paths]
    dataset = tf.data.Dataset.from_tensor_slices({
        'path': list(paths), 'label': list(labels),
        'orientation': [header.orientation for header in headers],
        'alpha': [header.alpha for header in headers],
        'size': [header.size for header in headers]})
    if shuffle_seed is not None:  # Only names are shuffled: a perfect shuffle costs no pixels.
      dataset = dataset.shuffle(len(files), seed=shuffle_seed)
    return dataset


@data_sources.SOURCES.register('folder', can_stream=True)
class FolderSource(ImageFilesSource):
  """The images under `root/<split>/<class name>/`."""

  def __init__(self, root: str, data_dir: str | None = None):
    del data_dir  # The root is the dataset itself.
    layout = (f'the layout is {root}/<split>/<class name>/<image file>, e.g. '
              f'{root}/train/cat/1.jpg')
    if not os.path.isdir(root):
      raise errors.ConfigError(f'Image folder {root!r} does not exist (config.dataset): '
                               f'{layout}.', key='dataset', value=root)
    splits = [name for name in _visible_entries(root) if os.path.isdir(os.path.join(root, name))]
    if not splits:
      raise errors.DataError(f'Image folder {root!r} has no split folders: {layout}.', what=root)
    class_folders = {split: [name for name in _visible_entries(os.path.join(root, split))
                             if os.path.isdir(os.path.join(root, split, name))]
                     for split in splits}
    for split, classes in class_folders.items():
      if not classes:
        raise errors.DataError(f'Split folder {os.path.join(root, split)!r} has no class '
                               f'folders: {layout}.', what=os.path.join(root, split))
    class_names = sorted({name for names in class_folders.values() for name in names})
    listed = {(split, name): image_files.listed_files(os.path.join(root, split, name))
              for split, names in class_folders.items() for name in names}
    logging.info('Image folder %s: splits %s, %d classes.', root, splits, len(class_names))
    headers, skipped = image_files.indexed_headers(
        root, [file for files in listed.values() for file in files])
    image_files.warn_skipped(skipped)
    if not headers:
      raise errors.DataError(f'Image folder {root!r} holds no readable '
                             f'{"/".join(image_files.FORMATS)} image ({len(skipped)} unreadable '
                             'files).', what=root)
    image_files.warn_transparent(headers)
    readable = {header.path for header in headers}
    files = {split: [] for split in splits}  # split -> [(path, label)]
    for (split, name), files_of_class in listed.items():
      paths_of_class = [path for path, _ in files_of_class if path in readable]
      if not paths_of_class:
        raise errors.DataError(f'Class folder {os.path.join(root, split, name)!r} holds no '
                               f'readable {"/".join(image_files.FORMATS)} image: add images or '
                               'remove it.', what=os.path.join(root, split, name))
      files[split] += [(path, class_names.index(name)) for path in paths_of_class]
    super().__init__(root, root, files, headers, class_names)
