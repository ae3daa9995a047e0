"""Small image-folder datasets generated for the tests: root/<split>/<class name>/<file>.

With damaged files, for the folder source's tests; the folders of photos users and the benchmarks
generate are `sample_folders`'s.
"""

import os

import numpy as np
from PIL import Image

import sample_folders

# Class name -> the part of the image that is bright. One name has a space, as users' do.
SHAPES = {'left half': lambda h, w: (slice(None), slice(0, w // 2)),
          'top': lambda h, w: (slice(0, h // 2), slice(None)),
          'centre': lambda h, w: (slice(h // 4, h - h // 4), slice(w // 4, w - w // 4))}


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
        image_format = sample_folders.FORMATS[index % len(sample_folders.FORMATS)]
        path = os.path.join(folder, f'{index:03d}.{sample_folders.EXTENSIONS[image_format]}')
        shape_image(rng, name, size, is_colour).save(path, format=image_format)
        files[split].append((path, name))
  if corrupt:
    folder = os.path.join(root, 'train', next(iter(SHAPES)))
    with open(os.path.join(folder, 'broken.png'), 'wb') as file:
      file.write(open(files['train'][0][0], 'rb').read()[:40])  # A PNG cut short.
    with open(os.path.join(folder, 'notes.txt'), 'w', encoding='utf-8') as file:
      file.write('not an image')
  return files
