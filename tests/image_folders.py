"""Small image-folder datasets generated for the tests: root/<split>/<class name>/<file>."""

import os

import numpy as np
from PIL import Image, ImageDraw, ImageFont

# Class name -> the part of the image that is bright. One name has a space, as users' do.
SHAPES = {'left half': lambda h, w: (slice(None), slice(0, w // 2)),
          'top': lambda h, w: (slice(0, h // 2), slice(None)),
          'centre': lambda h, w: (slice(h // 4, h - h // 4), slice(w // 4, w - w // 4))}
FORMATS = ('PNG', 'JPEG', 'BMP', 'GIF')
EXTENSIONS = {'PNG': 'png', 'JPEG': 'jpg', 'BMP': 'bmp', 'GIF': 'gif'}


def shape_image(rng: np.random.Generator, name: str, size: tuple[int, int],
                colour: bool) -> Image.Image:
  """A dark noisy image whose `SHAPES[name]` region is bright (a random colour if `colour`)."""
  height, width = size
  pixels = rng.integers(0, 60, (height, width, 3)).astype(np.uint8)
  bright = rng.integers(150, 256, 3) if colour else np.full(3, rng.integers(150, 256))
  pixels[SHAPES[name](height, width)] = bright
  image = Image.fromarray(pixels)
  return image if colour else image.convert('L')


def make_shapes_folder(root: str, sizes: dict[str, int], *, seed: int = 0,
                       image_sizes: tuple[int, int] = (12, 20), gray_every: int = 3,
                       colour: bool = True, corrupt: bool = True) -> dict[str, list[str]]:
  """Writes `sizes[split]` images per class and split; returns {split: [(path, class)]}.

  Sizes vary in `image_sizes` (height and width each, inclusive); formats cycle through
  PNG, JPEG, BMP and GIF; with `colour`, every `gray_every`-th image is grayscale, else all
  are. With `corrupt`, train/<first class> also gets a truncated PNG and a text file.
  """
  rng = np.random.default_rng(seed)
  files = {}
  for split, per_class in sizes.items():
    files[split] = []
    for name in SHAPES:
      folder = os.path.join(root, split, name)
      os.makedirs(folder, exist_ok=True)
      for index in range(per_class):
        size = tuple(rng.integers(image_sizes[0], image_sizes[1] + 1, 2))
        is_colour = colour and index % gray_every != 0
        image_format = FORMATS[index % len(FORMATS)]
        path = os.path.join(folder, f'{index:03d}.{EXTENSIONS[image_format]}')
        shape_image(rng, name, size, is_colour).save(path, format=image_format)
        files[split].append((path, name))
  if corrupt:
    folder = os.path.join(root, 'train', next(iter(SHAPES)))
    with open(os.path.join(folder, 'broken.png'), 'wb') as file:
      file.write(open(files['train'][0][0], 'rb').read()[:40])  # A PNG cut short.
    with open(os.path.join(folder, 'notes.txt'), 'w', encoding='utf-8') as file:
      file.write('not an image')
  return files


# Folders of one of three kinds of generated images, for the small-folder recipe
# (benchmarks/small_folders.py): every image has its own random colours (foreground and
# background at least _CONTRAST apart), scale, position or orientation, so no single pixel,
# colour or location gives the class away.
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
  height, width = size
  foreground, background = _colours(rng)
  image = Image.new('RGB', (width, height), background)
  radius = rng.uniform(0.2, 0.45) * min(height, width)  # 40-90% of the short side across.
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


def make_kind_folder(root: str, kind: str, *, seed: int = 0, num_images: int = 1000,
                     image_sizes: tuple[int, int] = (40, 80), messy: bool = True,
                     formats: tuple[str, ...] = FORMATS) -> int:
  """Writes `num_images` images of `KINDS[kind]` (equally many per class) to root/train/<class>.

  Height and width each vary in `image_sizes` (inclusive); formats cycle through `formats` (PNG,
  JPEG, BMP and GIF), and every 5th image is grayscale. With `messy`, each class folder also gets a
  truncated PNG, an empty file and a text file named like an image, and a hidden file.
  Returns the number of good images written.
  """
  names, draw = KINDS[kind]
  rng = np.random.default_rng(seed)
  per_class = num_images // len(names)
  for name in names:
    folder = os.path.join(root, 'train', name)
    os.makedirs(folder, exist_ok=True)
    for index in range(per_class):
      size = tuple(int(v) for v in rng.integers(image_sizes[0], image_sizes[1] + 1, 2))
      image = draw(rng, name, size)
      if index % 5 == 0:
        image = image.convert('L')
      image_format = formats[index % len(formats)]
      path = os.path.join(folder, f'{index:04d}.{EXTENSIONS[image_format]}')
      image.save(path, format=image_format)
    if messy:
      with open(os.path.join(folder, f'{0:04d}.{EXTENSIONS[formats[0]]}'), 'rb') as file:
        head = file.read(60)
      with open(os.path.join(folder, 'cut short.png'), 'wb') as file:
        file.write(head)
      open(os.path.join(folder, 'empty.jpg'), 'wb').close()
      with open(os.path.join(folder, 'readme.jpg'), 'w', encoding='utf-8') as file:
        file.write('not an image')
      with open(os.path.join(folder, '.DS_Store'), 'wb') as file:
        file.write(b'\x00' * 64)
  return per_class * len(names)
