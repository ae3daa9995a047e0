"""Folders of generated photos to try the app on: shapes, textures or digits, one folder a class.

    python -m sample_folders --kind=shapes --out=/tmp/shapes [--seed=0]
        [--num_images=1000] [--size=40,80] [--split=train] [--messy]
    python main.py --config=configs/images.py --workdir=/tmp/shapes_run --config.dataset=/tmp/shapes

Writes `<out>/<split>/<class>/<file>`, the layout `data_sources.folder_source` reads. Every image
has its own random colours (foreground and background at least `_CONTRAST` apart), scale,
position or orientation, so that no single pixel, colour or location gives the class away; sizes
vary, formats cycle through PNG, JPEG, BMP and GIF, and every 5th image is grayscale, as in a
folder of users' photos. With `messy`, each class folder also gets the files a real folder has
(a truncated PNG, an empty file, a text file named like an image, a hidden file), which the
folder source skips with one warning. The same seed writes the same folder.

A newcomer's first folder, and the folders the tests and the lab's benchmarks generate
(`benchmarks/small_folders.py`, `digit_transfer.py`): so it defines no flags at import.
"""

import os
import sys

from absl import app
from absl import flags
import numpy as np
from PIL import Image, ImageDraw, ImageFont

from core import errors

FORMATS = ('PNG', 'JPEG', 'BMP', 'GIF')
EXTENSIONS = {'PNG': 'png', 'JPEG': 'jpg', 'BMP': 'bmp', 'GIF': 'gif'}
_CONTRAST = 120  # Minimum Euclidean RGB distance between foreground and background.
_LUMA_CONTRAST = 40  # And of their luma, so that the grayscale copies stay legible.
_LUMA = np.array([0.299, 0.587, 0.114])  # ITU-R 601-2, as PIL's convert('L').


def _colours(rng: np.random.Generator) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """A random (foreground, background) pair of RGB colours that differ by `_CONTRAST`, and
  in luma by `_LUMA_CONTRAST`."""
  while True:
    foreground, background = rng.integers(0, 256, (2, 3))
    if (np.linalg.norm(foreground - background) >= _CONTRAST
        and abs(_LUMA @ (foreground - background)) >= _LUMA_CONTRAST):
      return tuple(int(v) for v in foreground), tuple(int(v) for v in background)


def _polygon(rng, centre, radius, corners):
  """The corners of a regular polygon (randomly rotated) around `centre`."""
  angles = rng.uniform(0, 2 * np.pi) + 2 * np.pi * np.arange(corners) / corners
  return [(centre[0] + radius * np.cos(a), centre[1] + radius * np.sin(a)) for a in angles]


def _cross(rng, centre, radius):
  """A plus sign of arm width radius/2, randomly rotated."""
  arm = radius / 4
  outline = [(arm, radius), (arm, arm), (radius, arm), (radius, -arm), (arm, -arm),
             (arm, -radius), (-arm, -radius), (-arm, -arm), (-radius, -arm), (-radius, arm),
             (-arm, arm), (-arm, radius)]
  angle = rng.uniform(0, np.pi / 2)
  cos, sin = np.cos(angle), np.sin(angle)
  return [(centre[0] + x * cos - y * sin, centre[1] + x * sin + y * cos) for x, y in outline]


def _draw_shape(rng, name, size):
  """One filled shape, 40-90% of the short side across, anywhere in the image."""
  height, width = size
  foreground, background = _colours(rng)
  image = Image.new('RGB', (width, height), background)
  radius = rng.uniform(0.2, 0.45) * min(height, width)
  centre = (rng.uniform(radius, width - radius), rng.uniform(radius, height - radius))
  draw = ImageDraw.Draw(image)
  if name == 'circle':
    draw.ellipse([centre[0] - radius, centre[1] - radius, centre[0] + radius,
                  centre[1] + radius], fill=foreground)
  elif name == 'cross':
    draw.polygon(_cross(rng, centre, radius), fill=foreground)
  else:
    draw.polygon(_polygon(rng, centre, radius, {'triangle': 3, 'square': 4}[name]),
                 fill=foreground)
  return image


def _draw_texture(rng, name, size):
  """Two colours in a pattern of random period and orientation, or blob noise. The period is
  12-25% of the long side, so that a 32-px square model input still resolves it."""
  height, width = size
  foreground, background = _colours(rng)
  period = rng.uniform(0.12, 0.25) * max(height, width)
  angle = rng.uniform(0, np.pi)
  y, x = np.mgrid[:height, :width].astype(np.float32)
  u = (x * np.cos(angle) + y * np.sin(angle)) / period  # Rotated coordinates, in periods.
  v = (-x * np.sin(angle) + y * np.cos(angle)) / period
  u, v = u + rng.uniform(0, 1), v + rng.uniform(0, 1)  # A random phase.
  if name == 'stripes':
    mask = (u % 1) < 0.5
  elif name == 'checks':
    mask = ((np.floor(u) + np.floor(v)) % 2) == 0
  elif name == 'dots':
    mask = ((u % 1 - 0.5) ** 2 + (v % 1 - 0.5) ** 2) < rng.uniform(0.2, 0.35) ** 2
  else:  # 'noise': coarse random values, smoothly upsampled, thresholded: blobs, no period.
    coarse = rng.random((int(height / period * 2) + 2, int(width / period * 2) + 2))
    smooth = np.asarray(Image.fromarray((coarse * 255).astype(np.uint8)).resize(
        (width, height), Image.BILINEAR))
    mask = smooth >= 128
  pixels = np.where(mask[..., None], np.array(foreground, np.uint8),
                    np.array(background, np.uint8))
  return Image.fromarray(pixels)


def _draw_digit(rng, name, size):
  """The digit in PIL's default font (Aileron), 50-90% of the image's height, randomly placed."""
  height, width = size
  foreground, background = _colours(rng)
  image = Image.new('RGB', (width, height), background)
  draw = ImageDraw.Draw(image)
  font = ImageFont.load_default(size=int(rng.uniform(0.5, 0.9) * height))
  left, top, right, bottom = draw.textbbox((0, 0), name, font=font)
  x = rng.uniform(0, max(width - (right - left), 0)) - left
  y = rng.uniform(0, max(height - (bottom - top), 0)) - top
  draw.text((x, y), name, fill=foreground, font=font)
  return image


# Kind -> (class names, drawing function (rng, class name, (height, width)) -> RGB image).
KINDS = {
    'shapes': (('circle', 'cross', 'square', 'triangle'), _draw_shape),
    'textures': (('checks', 'dots', 'noise', 'stripes'), _draw_texture),
    'digits': (tuple('0123456789'), _draw_digit),
}


def _write_messy_files(folder: str, good_file: str) -> None:
  """The unreadable files of a real folder: a truncated copy of `good_file`, an empty file, a
  text file named like an image, and a hidden file."""
  with open(good_file, 'rb') as file:
    head = file.read(60)
  with open(os.path.join(folder, 'cut short.png'), 'wb') as file:
    file.write(head)
  open(os.path.join(folder, 'empty.jpg'), 'wb').close()
  with open(os.path.join(folder, 'readme.jpg'), 'w', encoding='utf-8') as file:
    file.write('not an image')
  with open(os.path.join(folder, '.DS_Store'), 'wb') as file:
    file.write(b'\x00' * 64)


def make_kind_folder(root: str, kind: str, *, seed: int = 0, num_images: int = 1000,
                     image_sizes: tuple[int, int] = (40, 80), messy: bool = True,
                     formats: tuple[str, ...] = FORMATS, split: str = 'train') -> int:
  """Writes `num_images` images of `KINDS[kind]` (equally many per class) to root/split/<class>.

  Height and width each vary in `image_sizes` (inclusive); formats cycle through `formats`, and
  every 5th image is grayscale. With `messy`, each class folder also gets the unreadable files
  of `_write_messy_files`. Returns the number of good images written.
  """
  names, draw = KINDS[kind]
  rng = np.random.default_rng(seed)
  per_class = num_images // len(names)
  for name in names:
    folder = os.path.join(root, split, name)
    os.makedirs(folder, exist_ok=True)
    for index in range(per_class):
      size = tuple(int(v) for v in rng.integers(image_sizes[0], image_sizes[1] + 1, 2))
      image = draw(rng, name, size)
      if index % 5 == 0:
        image = image.convert('L')
      image_format = formats[index % len(formats)]
      path = os.path.join(folder, f'{index:04d}.{EXTENSIONS[image_format]}')
      image.save(path, format=image_format)
    if messy and per_class:
      _write_messy_files(folder, os.path.join(folder, f'0000.{EXTENSIONS[formats[0]]}'))
  return per_class * len(names)


def _define_flags() -> None:
  """The command line's flags: defined when run as one, never at import."""
  flags.DEFINE_enum('kind', 'shapes', list(KINDS), 'What the images show.')
  flags.DEFINE_string('out', None, 'The folder to write (<out>/<split>/<class>/...).')
  flags.DEFINE_integer('seed', 0, 'The generator seed: the same seed, the same folder.')
  flags.DEFINE_integer('num_images', 1000, 'Images in all, equally many per class.',
                       lower_bound=1)
  flags.DEFINE_list('size', ['40', '80'], 'Height and width in px: one side, or the range '
                    'that each is drawn from.')
  flags.DEFINE_string('split', 'train', 'The split folder to write.')
  flags.DEFINE_bool('messy', False, 'Add unreadable files to each class folder.')
  flags.mark_flag_as_required('out')


def _main(argv):
  """Writes the folder the flags describe and prints one line saying where."""
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  args = flags.FLAGS
  try:
    sizes = [int(size) for size in args.size]
  except ValueError:
    sizes = []
  if len(sizes) not in (1, 2) or min(sizes) < 8 or sizes[0] > sizes[-1]:
    sys.exit(errors.FlagError(
        f'--size={",".join(args.size)} is neither a side of at least 8 px (64) nor a range of '
        'sides (40,80).', flag='size', value=','.join(args.size)).one_line())
  classes = len(KINDS[args.kind][0])
  if args.num_images < classes:
    sys.exit(errors.FlagError(
        f'--num_images={args.num_images} is fewer than the {classes} classes of '
        f'--kind={args.kind}: give each class at least one image.', flag='num_images',
        value=args.num_images).one_line())
  written = make_kind_folder(args.out, args.kind, seed=args.seed, num_images=args.num_images,
                             image_sizes=(sizes[0], sizes[-1]), messy=args.messy,
                             split=args.split)
  print(f'Wrote {written} {args.kind} images to {os.path.join(args.out, args.split)}'
        + (' (and unreadable files, as a real folder has).' if args.messy else '.'))


if __name__ == '__main__':
  _define_flags()
  app.run(_main)
