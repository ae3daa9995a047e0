"""The image-file library: listing image files, reading their headers (kept in an index), and
decoding them as an image viewer shows them. The folder and CSV sources, predict and provenance
read image files through it.

Files are JPEG, PNG, BMP or GIF (its first frame), of any sizes. Pixels are the ones an image
viewer shows: a JPEG's EXIF orientation is applied, and a transparent PNG or BMP is composited
onto white. Hidden files and folders (.DS_Store, ._*) are not listed.

A header is read without the pixels (PIL reads the format, size, colour mode and orientation
from the first bytes, checks the file's structure, and a JPEG's end marker), so the sizes and
channels are known before anything is decoded, and files that are not readable images, truncated
ones included, are skipped with one warning naming them, instead of failing the decoder
mid-epoch. What the headers of a folder say is kept in an index (`indexed_headers`), so a folder
opened again reads only the headers of the files that changed.
"""

import collections.abc
import concurrent.futures
import dataclasses
import hashlib
import os
import tempfile
import time
import zipfile

from absl import logging
import numpy as np
from PIL import Image
import tensorflow as tf

from core import progress

FORMATS = ('JPEG', 'PNG', 'BMP', 'GIF')  # What tf.io.decode_image reads (PIL's format names).
_GRAY_MODES = ('1', 'L', 'LA', 'I', 'I;16', 'I;16B', 'I;16L', 'F')
_PALETTE_MODES = ('P', 'PA')
_ALPHA_MODES = ('LA', 'PA', 'RGBA', 'La', 'RGBa')
_EXIF_ORIENTATION = 0x0112
_JPEG_END = b'\xff\xd9'  # A JPEG's last marker (EOI): missing from a truncated file.
_SCAN_THREADS = 8  # Header reads wait on the disk more than on the CPU.
_NAMED_IN_WARNING = 5  # Files named in a warning.
_PROGRESS_SECONDS = 5  # Between progress lines while headers are read (none for a short scan).
_Stat = tuple[int, int, int]  # A file's (size, mtime, ctime), ns: what the index compares.


def _visible_files(folder: str) -> collections.abc.Iterator[os.DirEntry]:
  """Every visible file under `folder`, recursively, in `os.walk`'s order: a folder's files
  sorted by name, then each subfolder's, sorted; hidden entries are skipped, and, as `os.walk`
  does, folders that cannot be listed and links to folders are not entered."""
  try:
    with os.scandir(folder) as scan:
      entries = sorted((entry for entry in scan if not entry.name.startswith('.')),
                       key=lambda entry: entry.name)
  except OSError:
    return
  subfolders = [entry for entry in entries if _is_folder(entry)]
  yield from (entry for entry in entries if not _is_folder(entry))
  for subfolder in subfolders:
    if not subfolder.is_symlink():
      yield from _visible_files(subfolder.path)


def _is_folder(entry: os.DirEntry) -> bool:
  try:
    return entry.is_dir()
  except OSError:
    return False


def find_files(folder: str) -> list[str]:
  """Every visible file under `folder`, recursively, sorted; hidden folders are not entered."""
  return [entry.path for entry in _visible_files(folder)]


def listed_files(folder: str) -> list[tuple[str, _Stat | None]]:
  """`find_files(folder)`, each with its (size, mtime, ctime) in ns: one `stat` per file, no
  read."""
  listed = []
  for entry in _visible_files(folder):
    try:
      stat = entry.stat()
      listed.append((entry.path, (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)))
    except OSError:  # A broken link: never indexed, its header is read (and fails) each time.
      listed.append((entry.path, None))
  return listed


@dataclasses.dataclass(frozen=True)
class ImageHeader:
  """What an image file's header says, read without decoding the pixels."""
  path: str
  size: tuple[int, int]  # (height, width) as displayed: after the EXIF orientation.
  gray: bool
  orientation: int = 1  # EXIF orientation, 1-8 (1: as stored).
  alpha: bool = False


def _jpeg_complete(path: str) -> bool:
  """Whether the file ends with a JPEG end marker (some writers add a few bytes of padding)."""
  with open(path, 'rb') as file:
    file.seek(max(os.path.getsize(path) - 16, 0))
    return _JPEG_END in file.read()


def read_header(path: str) -> ImageHeader | None:
  """The header of an image file that `decode` reads, or None if `path` is not such a file."""
  try:
    with Image.open(path) as image:
      if image.format not in FORMATS:
        return None
      gray = image.mode in _GRAY_MODES or (image.mode in _PALETTE_MODES and _gray_palette(image))
      orientation = image.getexif().get(_EXIF_ORIENTATION, 1) if image.format == 'JPEG' else 1
      orientation = orientation if orientation in range(1, 9) else 1
      size = (image.height, image.width) if orientation < 5 else (image.width, image.height)
      alpha = image.format in ('PNG', 'BMP') and (image.mode in _ALPHA_MODES
                                                   or 'transparency' in image.info)
      header = ImageHeader(path, size, gray, orientation, alpha)
      image.verify()  # The file's structure (PNG checksums, ...), without decoding the pixels.
    if image.format == 'JPEG' and not _jpeg_complete(path):
      return None
  except Exception:  # pylint: disable=broad-except  (PIL raises many types for a bad file)
    return None
  return header


def _gray_palette(image: Image.Image) -> bool:
  palette = image.getpalette() or []  # Flat (r, g, b, r, g, b, ...).
  return all(r == g == b for r, g, b in zip(palette[0::3], palette[1::3], palette[2::3]))


def read_headers(paths: list[str]) -> tuple[list[ImageHeader], list[str]]:
  """The headers of the readable images among `paths` (in order), and the other paths.

  A scan that outlasts `_PROGRESS_SECONDS` logs a progress line at that interval: the files read,
  files/s and the time left.
  """
  start = time.time()
  # Counted by the reading threads (list.append is atomic): the main thread submits all the
  # reads first, and with the GIL shared among 8 readers, that alone can outlast most of them.
  finished = []
  rate = progress.Rate(0, len(paths))

  def read(path: str) -> ImageHeader | None:
    header = read_header(path)
    finished.append(True)
    return header

  def tick() -> None:
    if measured := rate.update(done := len(finished)):
      logging.info('Reading image headers: %d/%d files (%.1f%%), %.0f files/s, ETA %s.', done,
                   len(paths), 100 * done / len(paths), measured[0],
                   progress.duration(measured[1]))

  with (concurrent.futures.ThreadPoolExecutor(_SCAN_THREADS) as pool,
        progress.Ticker(tick, _PROGRESS_SECONDS)):
    headers = list(pool.map(read, paths))
  logging.info('Read the headers of %d files in %.1fs.', len(paths), time.time() - start)
  return ([header for header in headers if header is not None],
          [path for path, header in zip(paths, headers) if header is None])


def named(paths: list[str]) -> str:
  """A few of `paths`, and how many more."""
  more = f' and {len(paths) - _NAMED_IN_WARNING} more' if len(paths) > _NAMED_IN_WARNING else ''
  return ', '.join(paths[:_NAMED_IN_WARNING]) + more


def warn_skipped(paths: list[str]) -> None:
  """One warning for all the files skipped as unreadable, naming a few."""
  if paths:
    logging.warning('Skipped %d files that are not readable %s images (or are cut short): %s.',
                    len(paths), '/'.join(FORMATS), named(paths))


def warn_transparent(headers: list[ImageHeader]) -> None:
  """One warning for the images with transparency, which are composited onto white."""
  if transparent := [header.path for header in headers if header.alpha]:
    logging.warning('%d images have transparency, composited onto a white background: %s.',
                    len(transparent), named(transparent))


# The index of a folder: what each file's header said, with the file's size, mtime and ctime when
# it was read. The next open lists the folder with one `stat` per file (no read) and reads again
# only the headers of files that are new or whose size, mtime or ctime changed, so it detects a
# file added, removed, renamed, rewritten in place or replaced (mv, cp, an editor's save); mtime
# and ctime change with any write, and ctime also when a tool restores the mtime (cp -p, rsync,
# touch -r). Directory mtimes alone would be cheaper, but miss files rewritten in place. It cannot
# detect a change that keeps a file's size, mtime and ctime: bytes changed below the file system
# (a disk error, a raw block edit), or a same-size rewrite within one tick of the file system's
# clock (a few ms on Linux; 2 s on FAT). The labels and class names are not indexed: they are the
# folder names, which the listing reads anyway.
INDEX_FILE = '.image_index.npz'  # Hidden: the scan, predict and provenance's fingerprint skip it.
# Of the file's layout and of what `read_header` records and rejects: change either and bump it,
# so that older indexes are rebuilt rather than misread.
INDEX_VERSION = 1
_APP = 'flax-image-classification'  # The folder of the user's cache dir for indexes.
_Row = tuple[int, int, bool, int, bool] | None  # An ImageHeader's fields; None: not readable.
_UNREADABLE = (-1,) * 5  # A None row in the index file.


def index_path(root: str) -> str:
  """Where the index of the image folder `root` is kept.

  In `root`, as a hidden file, when `root` is writable: the index then serves every run, workdir
  and user of the folder, and moves with it (its paths are relative). Otherwise (a shared
  read-only dataset) in the user's cache dir ($XDG_CACHE_HOME, or ~/.cache), named by the
  folder's real path: not in a run's workdir, where a run with another workdir would not find it.
  """
  if _writable(root):
    return os.path.join(root, INDEX_FILE)
  cache = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  key = hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:32]
  return os.path.join(cache, _APP, 'image_index', f'{key}.npz')


def _writable(folder: str) -> bool:
  return os.access(folder, os.W_OK)


def indexed_headers(root: str, listed: list[tuple[str, _Stat | None]]
                    ) -> tuple[list[ImageHeader], list[str]]:
  """`read_headers` of the `listed` files under `root` (paths with their `_listed_files` stat),
  reading only the files that the index of `root` does not hold as they are now; the index is
  then saved with what was read, if anything changed."""
  path = index_path(root)
  indexed = _load_index(path)
  prefix = os.path.join(root, '')
  known = {file: entry for file, stat in listed
           if (entry := indexed.get(file[len(prefix):])) and entry[0] == stat}
  headers, _ = read_headers([file for file, _ in listed if file not in known])
  found = {header.path: header for header in headers}
  rows = {file[len(prefix):]: known.get(file) or (stat, _row(found.get(file)))
          for file, stat in listed if stat is not None}
  logging.info('Image folder index %s: %d of %d headers from it.', path, len(known), len(listed))
  if rows != indexed:
    _save_index(path, rows)
  found.update((file, ImageHeader(file, row[:2], bool(row[2]), row[3], bool(row[4])))
               for file, (_, row) in known.items() if row is not None)
  return ([found[file] for file, _ in listed if file in found],
          [file for file, _ in listed if file not in found])


def _row(header: ImageHeader | None) -> _Row:
  return header and (*header.size, header.gray, header.orientation, header.alpha)


def _load_index(path: str) -> dict[str, tuple[_Stat, _Row]]:
  """The entries of the index at `path`, by path relative to the folder; {} if there is none, or
  it is of another version, or damaged (then with one warning: it is rebuilt)."""
  if not os.path.exists(path):
    return {}
  try:
    with np.load(path, allow_pickle=False) as index:
      if (version := int(index['version'])) != INDEX_VERSION:
        logging.info('The image index %s is of version %d, not %d: rebuilding it.', path,
                     version, INDEX_VERSION)
        return {}
      names = index['names'].tobytes().decode()
      names, stats, rows = names.split('\0') if names else [], index['stats'], index['rows']
      if stats.shape != (len(names), 3) or rows.shape != (len(names), 5):
        raise ValueError(f'{len(names)} files, stats {stats.shape}, headers {rows.shape}')
      return dict(zip(names, zip(map(tuple, stats.tolist()),
                                 (tuple(row) if row[0] >= 0 else None for row in rows.tolist()))))
  except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
    logging.warning('Ignoring the damaged image index %s (%s: %s); rebuilding it: every header '
                    'is read again.', path, type(error).__name__, error)
    return {}


def _save_index(path: str, entries: dict[str, tuple[_Stat, _Row]]) -> None:
  """Writes the index atomically: to a unique temporary file beside it, then renamed over it, so
  that a reader, or another process opening the folder at the same time, sees a whole index; the
  worst a crash can leave is a damaged one, which is rebuilt. Failing to write it only warns.

  An .npz of arrays (names joined by NUL, which no file name holds): for 100,000 files, 8.6 MB
  loaded in 3.7 s where the same entries as JSON took 9.2 MB and 6.8 s (on 2 busy cores); and,
  unlike a pickle, loading it runs no code from a shared folder."""
  temporary = None
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.NamedTemporaryFile('wb', dir=os.path.dirname(path), prefix=INDEX_FILE,
                                     suffix='.tmp', delete=False) as file:
      temporary = file.name  # Hidden too (INDEX_FILE's leading dot).
      np.savez(file, version=INDEX_VERSION,
               names=np.frombuffer('\0'.join(entries).encode(), np.uint8),
               stats=np.array([stat for stat, _ in entries.values()], np.int64).reshape(-1, 3),
               rows=np.array([row or _UNREADABLE for _, row in entries.values()],
                             np.int64).reshape(-1, 5))
    os.chmod(temporary, 0o644)  # Readable by the folder's other users (mkstemp gives 0o600).
    os.replace(temporary, path)
  except OSError as error:
    logging.warning('Could not save the image index %s (%s): the next open reads every header '
                    'again.', path, error)
    if temporary and os.path.exists(temporary):
      os.remove(temporary)

# EXIF orientation 1-8 as a transpose followed by flips (TIFF's definition): with no control
# flow in the decoding graph, which costs tf.data more than the ops themselves.
_TRANSPOSED = (False, False, False, False, True, True, True, True)
_ROWS_FLIPPED = (False, False, True, True, False, False, True, True)
_COLUMNS_FLIPPED = (False, True, True, False, False, True, True, False)


def _oriented(image: tf.Tensor, orientation: tf.Tensor) -> tf.Tensor:
  """`image` turned as its EXIF `orientation` (1-8) says it is displayed."""
  index = orientation - 1
  image = tf.transpose(image, tf.where(tf.gather(_TRANSPOSED, index), [1, 0, 2], [0, 1, 2]))
  flipped = tf.stack([tf.gather(_ROWS_FLIPPED, index), tf.gather(_COLUMNS_FLIPPED, index)])
  return tf.reverse(image, tf.boolean_mask([0, 1], flipped))


def _stored_window(window: tf.Tensor, stored_size: tf.Tensor, orientation: tf.Tensor
                   ) -> tf.Tensor:
  """The window [top, left, height, width] of an image as displayed, in the pixels as stored:
  `_oriented`'s flips undone (in the displayed size), then its transpose."""
  index = orientation - 1
  transposed = tf.gather(_TRANSPOSED, index)
  displayed_height, displayed_width = tf.unstack(
      tf.where(transposed, tf.reverse(stored_size, [0]), stored_size))
  top, left, height, width = tf.unstack(window)
  top = tf.where(tf.gather(_ROWS_FLIPPED, index), displayed_height - top - height, top)
  left = tf.where(tf.gather(_COLUMNS_FLIPPED, index), displayed_width - left - width, left)
  unflipped = tf.stack([top, left, height, width])
  return tf.where(transposed, tf.gather(unflipped, [1, 0, 3, 2]), unflipped)


def decode(path: tf.Tensor, channels: int, orientation: tf.Tensor | int = 1,
           alpha: tf.Tensor | bool = False) -> tf.Tensor:
  """The uint8 pixels (height, width, channels) of an image file as displayed; a GIF's first
  frame.

  Decoded to 3 channels, the only count besides the file's own that decode_image's decoders all
  give (a grayscale image's 3 channels are equal, so its first channel is its exact gray
  value); with `alpha` (a PNG or BMP with transparency, as its header says) to RGBA, composited
  onto white. Then the EXIF `orientation` is applied.
  """
  return _decoded_data(tf.io.read_file(path), channels, orientation, alpha)


def decode_window(path: tf.Tensor, channels: int, window: tf.Tensor,
                  orientation: tf.Tensor | int = 1, alpha: tf.Tensor | bool = False) -> tf.Tensor:
  """The `window` [top, left, height, width] of what `decode` gives. Of a JPEG only the window
  is decoded (`tf.image.decode_and_crop_jpeg`, the window turned to the stored pixels by the
  EXIF orientation); other files are decoded whole and cut."""
  data = tf.io.read_file(path)
  orientation = tf.cast(orientation, tf.int32)

  def jpeg_window() -> tf.Tensor:
    stored = _stored_window(window, tf.image.extract_jpeg_shape(data)[:2], orientation)
    return _oriented(tf.image.decode_and_crop_jpeg(data, stored, channels=3),
                     orientation)[..., :channels]

  def whole() -> tf.Tensor:
    top, left, height, width = tf.unstack(window)
    image = _decoded_data(data, channels, orientation, alpha)
    return tf.slice(image, [top, left, 0], [height, width, -1])

  return tf.cond(tf.io.is_jpeg(data), jpeg_window, whole)


def _decoded_data(data: tf.Tensor, channels: int, orientation: tf.Tensor | int,
                  alpha: tf.Tensor | bool) -> tf.Tensor:
  """`decode` of a file's bytes `data`."""

  def composited() -> tf.Tensor:
    image = tf.cast(tf.io.decode_image(data, channels=4, expand_animations=False), tf.float32)
    rgb, opacity = image[..., :3], image[..., 3:] / 255
    return tf.cast(tf.round(rgb * opacity + 255 * (1 - opacity)), tf.uint8)

  image = tf.cond(tf.cast(alpha, tf.bool), composited,
                  lambda: tf.io.decode_image(data, channels=3, expand_animations=False))
  return _oriented(image, tf.cast(orientation, tf.int32))[..., :channels]
