"""Images labelled by a CSV file: `file,label[,split]` rows next to a folder of images, the
layout of Kaggle-style datasets.

`config.dataset` is the CSV file. Its first line names the columns; the options
(`config.data_source_options.csv`) say which hold the file and the label, and the folder that
relative file names are in (`images`; a relative folder is taken from the CSV's folder, and
absolute file names are used as they are). Kaggle's files are often named by an id without an
extension: `extension='.png'` appends one to every name that does not end with it. With a split
column, each row belongs to the split it names; without one, every row is in split 'train'.
Splits take TFDS's split syntax ('train[:90%]+test').

Class names are the distinct labels, sorted, integer labels numerically ('2' before '10', so
labels 0..N-1 keep their numbers), over all rows: a label means the same class in every split.
Images are read as the folder source reads them (`image_files`): headers first, JPEG, PNG, BMP
or GIF of any sizes, 1 channel when every image is grayscale, otherwise 3, EXIF orientation
applied, transparency composited onto white, ordered within a split by a hash of their path,
streamed or decoded into memory. A row without a file name, label or split, whose file does not
exist or is not a readable image, or that repeats an earlier row's file, is skipped; one warning
says how many and names a few by their line in the CSV, with the reason.
"""

import csv
import dataclasses
import os
import re

from absl import logging

from core import errors
import data_sources
from data_sources import folder_source
from data_sources import image_files

_OPTIONS = 'data_source_options.csv'  # Where the options live in the config, for errors.
_DEFAULT_SPLIT = 'train'  # The split of every row of a CSV without a split column.
_INTEGER = re.compile(r'[+-]?[0-9]+')


def _class_order(label: str) -> tuple:
  """Sort key of class names: integers by value, before other names, which sort as strings."""
  if _INTEGER.fullmatch(label):
    return (0, int(label), label)
  return (1, 0, label)


def _cell(row: list[str], index: int | None) -> str:
  """The value of column `index` in `row` without surrounding spaces; '' if the row is short."""
  return row[index].strip() if index is not None and index < len(row) else ''


def _read_rows(csv_path: str) -> tuple[list[str], list[tuple[int, list[str]]]]:
  """The column names of a CSV file and its non-blank rows, each with its line number."""
  try:
    # utf-8-sig: a byte-order mark, as Excel writes one, is not part of the first column's name.
    with open(csv_path, newline='', encoding='utf-8-sig') as file:
      reader = csv.reader(file)
      header = next(reader, None)
      rows = [(reader.line_num, row) for row in reader if any(cell.strip() for cell in row)]
  except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as error:
    raise errors.ConfigError(f'CSV file {csv_path!r} does not exist (config.dataset): the CSV '
                             'source reads a file with a line of column names, such as '
                             'file,label, then one row per image.',
                             key='dataset', value=csv_path) from error
  except (OSError, UnicodeDecodeError, csv.Error) as error:
    raise errors.DataError(f'CSV file {csv_path!r} cannot be read as UTF-8 CSV: {error}.',
                           what=csv_path) from error
  if header is None:
    raise errors.DataError(f'CSV file {csv_path!r} is empty: it needs a line of column names, '
                           'such as file,label, then one row per image.', what=csv_path)
  return [name.strip() for name in header], rows


def _column(columns: list[str], option: str, name: str, csv_path: str) -> int:
  """The index of column `name` (the value of option `option`); a `ConfigError` naming the
  option and the columns the file has if it has no such column."""
  if name in columns:
    return columns.index(name)
  raise errors.ConfigError(
      f'CSV file {csv_path!r} has no column {name!r} (config.{_OPTIONS}.{option}); its columns: '
      f'{", ".join(columns)}. Set config.{_OPTIONS}.{option} to the right one.',
      key=f'{_OPTIONS}.{option}', value=name, what=csv_path, columns=tuple(columns))


@dataclasses.dataclass(frozen=True)
class _Row:
  """A row of the CSV that names an image: its line, file name as written (with the extension)
  and path, label and split."""
  line: int
  name: str
  path: str
  label: str
  split: str


def _image_rows(rows: list[tuple[int, list[str]]], indexes: tuple[int, int, int | None],
                folder: str, extension: str) -> tuple[list[_Row], dict[int, str]]:
  """The rows with a file name, label and split, the first of each file; and the lines of the
  others, each with why it is skipped.

  Args:
    rows: (line, cells) of every row.
    indexes: the columns of the file name, the label and the split (None: all in 'train').
    folder: the folder of relative file names.
    extension: appended to the file names that do not end with it.
  """
  file_index, label_index, split_index = indexes
  image_rows, skipped, first_line = [], {}, {}  # first_line: path -> the line that names it.
  for line, cells in rows:
    name, label = _cell(cells, file_index), _cell(cells, label_index)
    split = _cell(cells, split_index) if split_index is not None else _DEFAULT_SPLIT
    if name and extension and not name.lower().endswith(extension.lower()):
      name += extension
    path = os.path.normpath(os.path.join(folder, name))
    if not name or not label or not split:
      skipped[line] = f'no {"file name" if not name else "label" if not label else "split"}'
    elif path in first_line:  # The same image twice: a label conflict or a leak across splits.
      skipped[line] = f'{name}: repeats line {first_line[path]}'
    else:
      first_line[path] = line
      image_rows.append(_Row(line, name, path, label, split))
  return image_rows, skipped


@data_sources.SOURCES.register('csv', can_stream=True)
class CsvSource(folder_source.ImageFilesSource):
  """The images that the rows of a CSV file name, with their labels (and splits)."""

  def __init__(
      self, csv_path: str, data_dir: str | None = None, *, images: str | None = None,
      file_column: str = 'file', label_column: str = 'label', split_column: str = 'split',
      extension: str = ''):
    """Reads the CSV and the headers of its images.

    Args:
      csv_path: the CSV file (config.dataset).
      data_dir: unused: the CSV names the dataset's files.
      images: the folder that relative file names are in; relative to the CSV's folder.
        Default: the CSV's folder.
      file_column: the column of image file names (or ids, with `extension`).
      label_column: the column of labels, any strings.
      split_column: the column of split names, if the CSV has one; else all rows are 'train'.
      extension: appended to every file name that does not end with it, e.g. '.png'.
    """
    del data_dir  # The CSV names the dataset's files.
    if extension and not extension.startswith('.'):
      extension = '.' + extension
    columns, rows = _read_rows(csv_path)
    folder = os.path.normpath(os.path.join(os.path.dirname(csv_path), images or ''))
    if not os.path.isdir(folder):
      raise errors.ConfigError(f'Image folder {folder!r} (config.{_OPTIONS}.images={images!r}, '
                               f'relative to the folder of {csv_path}) does not exist.',
                               key=f'{_OPTIONS}.images', value=images)
    file_index = _column(columns, 'file_column', file_column, csv_path)
    label_index = _column(columns, 'label_column', label_column, csv_path)
    split_index = columns.index(split_column) if split_column in columns else None
    if split_index is None:
      logging.info('CSV file %s has no %r column: every row is in split %r.', csv_path,
                   split_column, _DEFAULT_SPLIT)

    class_names = sorted({_cell(row, label_index) for _, row in rows} - {''}, key=_class_order)
    image_rows, skipped = _image_rows(rows, (file_index, label_index, split_index), folder,
                                       extension)
    headers, unreadable = image_files.read_headers([row.path for row in image_rows])
    unreadable = set(unreadable)
    for row in image_rows:
      if row.path in unreadable:
        skipped[row.line] = (
            f'{row.name}: not a readable {"/".join(image_files.FORMATS)} image, or cut short'
            if os.path.isfile(row.path) else f'{row.name}: no such file')
    reasons = [f'line {line} ({skipped[line]})' for line in sorted(skipped)]
    if not headers:
      appended = f', with {extension!r} appended' if extension else ''
      raise errors.DataError(
          f'CSV file {csv_path!r} has no usable row (of {len(rows)}): '
          f'{image_files.named(reasons) or "it has none"}. '
          f'File names are read relative to {folder} (config.{_OPTIONS}.images){appended}.',
          what=csv_path)
    if reasons:
      logging.warning('Skipped %d of %d rows of %s: %s.', len(reasons), len(rows), csv_path,
                      image_files.named(reasons))
    image_files.warn_transparent(headers)

    label_ids = {name: label for label, name in enumerate(class_names)}
    readable = {header.path for header in headers}
    files = {}  # split -> [(path, label)]
    for row in image_rows:
      if row.path in readable:
        files.setdefault(row.split, []).append((row.path, label_ids[row.label]))
    logging.info('CSV file %s: splits %s, %d classes.', csv_path,
                 {split: len(split_files) for split, split_files in files.items()},
                 len(class_names))
    super().__init__(csv_path, folder, files, headers, class_names)
