"""Image folders: `root/<split>/<class name>/<image file>`, the layout of Keras, torchvision,
Hugging Face and TFDS's `ImageFolder`.

Splits are the root's subfolders and take TFDS's split syntax ('train[:90%]+test'). Class names
are the class folders' names, sorted; they are the union over all splits, so a label means the
same class in every split. Files are JPEG, PNG, BMP or GIF (its first frame), of any sizes; an
image has 1 channel when every image of the dataset is grayscale, otherwise 3 (grayscale images
are converted).

Opening the folder reads every file's header, not its pixels (PIL reads the format, size and
colour mode from the first bytes, and checks the file's structure), so the sizes and channels
are known before anything is decoded, and files that are not readable images are skipped, with
one warning, instead of failing the decoder mid-epoch. Within a split, files are ordered by a
hash of their path: stable across runs and machines, and mixed across classes, so that a slice
such as 'train[:90%]' holds every class (TFDS orders its examples the same way).

Hand-written rather than `tfds.folder_dataset.ImageFolder`, which reads only .jpg/.jpeg/.png
files, fails on the first unreadable file, shuffles without a seed, and needs the channel count
given up front.
"""

import concurrent.futures
import dataclasses
import hashlib
import os
import time

from absl import logging
from PIL import Image
import tensorflow as tf

from data_sources import base

FORMATS = ('JPEG', 'PNG', 'BMP', 'GIF')  # What tf.io.decode_image reads (PIL's format names).
_GRAY_MODES = ('1', 'L', 'LA', 'I', 'I;16', 'I;16B', 'I;16L', 'F')
_PALETTE_MODES = ('P', 'PA')
_SCAN_THREADS = 8  # Header reads wait on the disk more than on the CPU.
_NAMED_IN_WARNING = 5  # Skipped files named in the warning.


@dataclasses.dataclass(frozen=True)
class ImageHeader:
  """What an image file's header says, read without decoding the pixels."""
  path: str
  size: tuple[int, int]  # (height, width)
  gray: bool


def read_header(path: str) -> ImageHeader | None:
  """The header of an image file that `decode` reads, or None if `path` is not such a file."""
  try:
    with Image.open(path) as image:
      if image.format not in FORMATS:
        return None
      gray = image.mode in _GRAY_MODES or (image.mode in _PALETTE_MODES and _gray_palette(image))
      header = ImageHeader(path, (image.height, image.width), gray)
      image.verify()  # The file's structure (PNG checksums, ...), without decoding the pixels.
  except Exception:  # pylint: disable=broad-except  (PIL raises many types for a bad file)
    return None
  return header


def _gray_palette(image: Image.Image) -> bool:
  palette = image.getpalette() or []  # Flat (r, g, b, r, g, b, ...).
  return all(r == g == b for r, g, b in zip(palette[0::3], palette[1::3], palette[2::3]))


def read_headers(paths: list[str]) -> tuple[list[ImageHeader], list[str]]:
  """The headers of the readable images among `paths` (in order), and the other paths."""
  start = time.time()
  with concurrent.futures.ThreadPoolExecutor(_SCAN_THREADS) as pool:
    headers = list(pool.map(read_header, paths))
  logging.info('Read the headers of %d files in %.1fs.', len(paths), time.time() - start)
  return ([header for header in headers if header is not None],
          [path for path, header in zip(paths, headers) if header is None])


def warn_skipped(paths: list[str]) -> None:
  """One warning for all the files skipped as unreadable, naming a few."""
  if paths:
    named = ', '.join(paths[:_NAMED_IN_WARNING])
    more = f' and {len(paths) - _NAMED_IN_WARNING} more' if len(paths) > _NAMED_IN_WARNING else ''
    logging.warning('Skipped %d files that are not readable %s images: %s%s.', len(paths),
                    '/'.join(FORMATS), named, more)


def decode(path: tf.Tensor, channels: int) -> tf.Tensor:
  """The uint8 pixels (height, width, channels) of an image file; a GIF's first frame.

  Decoded to 3 channels, the only count that decode_image's BMP and GIF decoders give besides
  the file's own; a grayscale image's 3 channels are equal, so its first channel is its exact
  gray value.
  """
  image = tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)
  return image[..., :channels]


def _visible_entries(folder: str) -> list[str]:
  """The entries of `folder`, sorted, without hidden ones (.DS_Store, ._* and the like)."""
  return sorted(entry for entry in os.listdir(folder) if not entry.startswith('.'))


class FolderSource(base.RangeSource):
  """The images under `root/<split>/<class name>/`."""

  def __init__(self, root: str):
    layout = f'the layout is {root}/<split>/<class name>/<image file>, e.g. {root}/train/cat/1.jpg'
    if not os.path.isdir(root):
      raise base.DataError(f'Image folder {root!r} does not exist (config.dataset): {layout}.')
    splits = [name for name in _visible_entries(root) if os.path.isdir(os.path.join(root, name))]
    if not splits:
      raise base.DataError(f'Image folder {root!r} has no split folders: {layout}.')
    class_folders = {split: [name for name in _visible_entries(os.path.join(root, split))
                             if os.path.isdir(os.path.join(root, split, name))]
                     for split in splits}
    for split, classes in class_folders.items():
      if not classes:
        raise base.DataError(f'Split folder {os.path.join(root, split)!r} has no class folders: '
                             f'{layout}.')
    class_names = sorted({name for names in class_folders.values() for name in names})
    paths = {(split, name): [os.path.join(root, split, name, file)
                             for file in _visible_entries(os.path.join(root, split, name))]
             for split, names in class_folders.items() for name in names}
    logging.info('Image folder %s: splits %s, %d classes.', root, splits, len(class_names))
    headers, skipped = read_headers([path for files in paths.values() for path in files])
    warn_skipped(skipped)
    readable = {header.path: header for header in headers}
    self._files = {split: [] for split in splits}  # split -> [(path, label)]
    for (split, name), files in paths.items():
      files = [path for path in files if path in readable]
      if not files:
        raise base.DataError(f'Class folder {os.path.join(root, split, name)!r} holds no '
                             f'readable {"/".join(FORMATS)} image: add images or remove it.')
      self._files[split] += [(path, class_names.index(name)) for path in files]
    for split, files in self._files.items():
      files.sort(key=lambda file: hashlib.md5(os.path.relpath(file[0], root).encode()).digest())
    self._channels = 1 if all(header.gray for header in headers) else 3
    sizes = {header.size for header in headers}
    self._size = sizes.pop() if len(sizes) == 1 else (None, None)
    super().__init__(root, {split: len(files) for split, files in self._files.items()},
                     len(class_names), self._load_range, class_names)

  @property
  def image_shape(self) -> tuple[int | None, int | None, int]:
    return (*self._size, self._channels)

  def examples(self, split: base.SplitArg, shuffle_seed: int | None = None) -> tf.data.Dataset:
    return self._decoded([file for name, part in self._ranges(split)
                          for file in self._files[name][part]], shuffle_seed)

  def _load_range(self, name: str, part: slice) -> base.Split:
    return base.materialize(self._decoded(self._files[name][part]))

  def _decoded(self, files: list[tuple[str, int]],
               shuffle_seed: int | None = None) -> tf.data.Dataset:
    """The images of `files`, decoded in parallel, in order (or shuffled by `shuffle_seed`)."""
    paths, labels = zip(*files)
    dataset = tf.data.Dataset.from_tensor_slices((list(paths), list(labels)))
    if shuffle_seed is not None:  # Only names are shuffled: a perfect shuffle costs no pixels.
      dataset = dataset.shuffle(len(files), seed=shuffle_seed)
    return dataset.map(
        lambda path, label: {'image': decode(path, self._channels),
                             'label': tf.cast(label, tf.int32)},
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
