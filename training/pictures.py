"""Pictures of an evaluation for TensorBoard: a labelled confusion matrix, a captioned error grid,
a reliability diagram.

Drawn with PIL's built-in font, so they look the same on every machine. Both are sized for
TensorBoard's image cards: readable at the card's width for 10 classes, and for 100 classes
still a usable overview (cells shrink, labels thin out, names are shortened).
"""

import math

import numpy as np
from PIL import Image
from PIL import ImageDraw
from PIL import ImageFont

_FONT_SIZE = 14
_FONT = ImageFont.load_default(size=_FONT_SIZE)
_NAME_CHARS = 14  # Class names are shortened to this many characters.
_MATRIX_PIXELS = 400  # The matrix's cells take about this many pixels across.
_MIN_TILE = 56  # Pixels per example in the grid, at least (MNIST digits are drawn 2x).
_GRID_PIXELS = 400  # The grid is at most about this wide: captions stay legible in a card.
_NUMBER_CELL = 28  # Cells at least this big show their count.
_AXES = 'rows: true class, columns: predicted'


def short_name(name: str, limit: int = _NAME_CHARS) -> str:
  """`name` cut to `limit` characters, with '..' in its middle if it was longer."""
  if len(name) <= limit:
    return name
  head = (limit - 2) // 2
  return f'{name[:head]}..{name[len(name) - (limit - 2 - head):]}'


def _text_width(text: str) -> int:
  return int(math.ceil(_FONT.getlength(text)))


def _shade(share: float, diagonal: bool) -> tuple[int, int, int]:
  """Blue for correct predictions, red for errors; the larger the row's share, the darker.

  Any error is tinted, and errors are shaded by the square root of their share, so that a cell
  holding 1% of its row is plainly pink beside the white cells that hold none.
  """
  if diagonal:
    strength = 0.85 * share
  else:
    strength = 0.15 + 0.7 * math.sqrt(share) if share > 0 else 0.0
  light = int(round(255 * (1 - strength)))
  return (light, light, 255) if diagonal else (255, light, light)


def confusion_matrix(counts: np.ndarray, class_names: tuple[str, ...] = ()) -> np.ndarray:
  """A uint8 RGB heat map of `counts` (rows: true class, columns: predicted class).

  Each row is shaded by its shares (normalised rows: a rare class reads as well as a common
  one), with the counts written in cells large enough. Rows are labelled 'index name',
  columns by index; with many classes, every n-th label.
  """
  num_classes = len(counts)
  names = [short_name(name) for name in (class_names or map(str, range(num_classes)))]
  cell = max(4, min(40, _MATRIX_PIXELS // num_classes))
  every = max(1, math.ceil((_FONT_SIZE + 2) / cell))  # Label every n-th row and column.
  # Rows: 'index name', or the name alone where it is the index ('7' for MNIST's 7).
  row_labels = [(names[k] if names[k] == str(k) else f'{k} {names[k]}') if k % every == 0
                else '' for k in range(num_classes)]
  left = max(_text_width(label) for label in row_labels) + 10
  top = 2 * _FONT_SIZE + 14
  size = (max(left + num_classes * cell + 4, _text_width(_AXES) + 8),
          top + num_classes * cell + _FONT_SIZE + 10)
  image = Image.new('RGB', size, 'white')
  draw = ImageDraw.Draw(image)
  draw.text((4, 2), _AXES, fill='black', font=_FONT)
  shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
  # Columns are labelled by index, as far apart as the widest index needs.
  column_every = every * math.ceil((_text_width(str(num_classes - 1)) + 6) / (cell * every))
  for k in range(0, num_classes, column_every):
    index = str(k)
    draw.text((left + k * cell + (cell - _text_width(index)) / 2, _FONT_SIZE + 6), index,
              fill='black', font=_FONT)
  for k in range(0, num_classes, every):
    draw.text((4, top + k * cell + (cell - _FONT_SIZE) / 2 - 2), row_labels[k], fill='black',
              font=_FONT)
  for (true, predicted), count in np.ndenumerate(counts):
    fill = _shade(shares[true, predicted], true == predicted)
    x, y = left + predicted * cell, top + true * cell
    draw.rectangle((x, y, x + cell - 1, y + cell - 1), fill=fill,
                   outline='lightgray' if cell >= 8 else None)
    if cell >= _NUMBER_CELL and count:
      text = str(count)
      dark = sum(fill) < 3 * 140
      draw.text((x + (cell - _text_width(text)) / 2, y + (cell - _FONT_SIZE) / 2 - 2), text,
                fill='white' if dark else 'black', font=_FONT)
  total = counts.sum()
  draw.text((4, size[1] - _FONT_SIZE - 6), f'{total} examples, rows normalised; '
            f'accuracy {np.trace(counts) / max(total, 1):.2%}', fill='dimgray', font=_FONT)
  return np.asarray(image)


def reliability_diagram(counts: np.ndarray, confidences: np.ndarray,
                        correct: np.ndarray) -> np.ndarray:
  """A uint8 RGB reliability diagram of equal-width confidence bins, from each bin's example
  count and sums of confidence and of correct predictions: a bar of the bin's accuracy, its gap
  to the bin's mean confidence (red where the confidence is higher, overconfident; purple where
  lower), the diagonal of perfect calibration, and the ECE.

  Empty bins have no bar. Under the axis, each bin's share of the examples as a thin gray bar,
  so that a large gap in a nearly empty bin reads as the little it weighs.
  """
  bins = len(counts)
  side, left, top, share_height = _MATRIX_PIXELS, 48, 2 * _FONT_SIZE + 10, 30
  bottom = top + side
  image = Image.new('RGB', (left + side + 12, bottom + share_height + 2 * _FONT_SIZE + 16),
                    'white')
  draw = ImageDraw.Draw(image)
  total = max(int(counts.sum()), 1)
  ece = float(np.abs(correct - confidences).sum()) / total
  draw.text((4, 2), f'reliability: accuracy per confidence bin; ECE {ece:.2%}', fill='black',
            font=_FONT)
  draw.text((4, _FONT_SIZE + 4), 'mean confidence above the accuracy: red; below: purple',
            fill='dimgray', font=_FONT)
  y = lambda value: bottom - value * side  # Accuracy or confidence to pixels.
  width = side / bins
  for m in range(bins):
    x0, x1 = left + m * width, left + (m + 1) * width - 1
    if counts[m]:
      accuracy, confidence = correct[m] / counts[m], confidences[m] / counts[m]
      draw.rectangle((x0, y(accuracy), x1, bottom), fill=(90, 120, 220), outline='white')
      over = confidence > accuracy  # Overconfident: the gap rises above the bar.
      draw.rectangle((x0, min(y(accuracy), y(confidence)), x1, max(y(accuracy), y(confidence))),
                     fill=(235, 110, 110) if over else (160, 70, 170), outline='white')
    draw.rectangle((x0, bottom + share_height * (1 - counts[m] / total) + 4, x1,
                    bottom + share_height + 4), fill='gray')
  draw.line((left, bottom, left + side, top), fill='dimgray', width=1)  # Perfect calibration.
  draw.rectangle((left, top, left + side, bottom), outline='black')
  for tick in (0.0, 0.5, 1.0):
    label = f'{tick:.1f}'
    draw.text((left - _text_width(label) - 4, y(tick) - _FONT_SIZE / 2 - 2), label, fill='black',
              font=_FONT)
    if tick != 0.5:  # The axis's name is in the middle.
      draw.text((left + tick * side - _text_width(label) / 2, bottom + share_height + 8), label,
                fill='black', font=_FONT)
  draw.text((left + side / 2 - _text_width('confidence') / 2, bottom + share_height + 8),
            'confidence', fill='dimgray', font=_FONT)
  return np.asarray(image)


def displayable(images: np.ndarray) -> np.ndarray:
  """uint8 pixels of preprocessed float images: each image's range stretched to 0-255."""
  low = images.min(axis=(1, 2, 3), keepdims=True)
  high = images.max(axis=(1, 2, 3), keepdims=True)
  return np.uint8(np.round(255 * (images - low) / np.maximum(high - low, 1e-6)))


def misclassified_grid(images: np.ndarray, labels: np.ndarray, predictions: np.ndarray,
                       class_names: tuple[str, ...] = ()) -> np.ndarray:
  """A uint8 RGB grid of `images` (N, H, W, C) as the model saw them, each captioned
  'true -> predicted' with class names."""
  names = class_names or tuple(map(str, range(int(max(labels.max(), predictions.max())) + 1)))
  captions = [f'{short_name(names[label], 9)} -> {short_name(names[predicted], 9)}'
              for label, predicted in zip(labels, predictions)]
  num, height, width, _ = images.shape
  scale = max(1, math.ceil(_MIN_TILE / max(height, width)))
  tile_width, tile_height = width * scale, height * scale
  cell_width = max(tile_width, max(map(_text_width, captions))) + 8
  cell_height = tile_height + _FONT_SIZE + 8
  columns = max(1, min(math.ceil(math.sqrt(num)), _GRID_PIXELS // cell_width))
  grid = Image.new('RGB', (columns * cell_width, math.ceil(num / columns) * cell_height), 'white')
  draw = ImageDraw.Draw(grid)
  for i, (pixels, caption) in enumerate(zip(displayable(images), captions)):
    x, y = i % columns * cell_width, i // columns * cell_height
    tile = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels).convert('RGB')
    grid.paste(tile.resize((tile_width, tile_height), Image.NEAREST),
               (x + (cell_width - tile_width) // 2, y + _FONT_SIZE + 6))
    draw.text((x + (cell_width - _text_width(caption)) / 2, y + 2), caption, fill='firebrick',
              font=_FONT)
  return np.asarray(grid)
