"""Training-input speed at photo size: this app's pipeline against PyTorch's DataLoader.

    python -m benchmarks.input_pipeline --config=configs/finetune.py \
      --config.data_source=folder --config.dataset=ROOT [--epochs=2] [--make_folder=4000]

Reads the training split of `config` as `main.py` trains on it (`input_pipeline.open_split` and
`train_batches`: decode, crop, flip, uint8 batches; no model), epoch after epoch, and times each
epoch: the first decodes the files (and fills the decoded cache, config.decoded_cache), the
later ones crop from the cache. With torch and torchvision installed (the extras), the same
folder goes through torchvision's `ImageFolder` and a `DataLoader` (`RandomResizedCrop`,
`RandomHorizontalFlip`, `ToTensor`, `Normalize`; `num_workers` = the usable cores, batch and
drop_last as the app's); with grain installed too, a Grain pipeline (`MapDataset` of the file
names, PIL decoding and torchvision's crop and flip in `mp_prefetch`'s worker processes, uint8
batches as the app's). One epoch of each peer runs after each of the app's: they alternate in
one process, so that a drifting machine load hits all alike. Images/s count the images batched.

With config.preprocess left empty, the app runs --preprocess, the equivalent of the PyTorch
transforms. --make_folder=N first writes N generated JPEGs of 180-320 px in 10 classes to
ROOT/train (data_sources/generated.py's digits) when ROOT does not exist.

Printed: the machine (CPU model, AVX2/AVX-512/AMX, cores), the load average before and after,
one line per epoch, and a summary of every epoch's images/s whose last line is the app's last
epoch (`<name>: <N> images/s`); --json writes them (`harness.write_json`).
"""

import os
import time

from absl import app
from absl import flags
from ml_collections import config_flags
import numpy as np

from benchmarks import harness
from data_sources import generated

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', 'configs/finetune.py', 'The training config.')
flags.DEFINE_integer('epochs', 2, 'Epochs of each pipeline (the first fills the decoded cache).',
                     lower_bound=1)
flags.DEFINE_string('preprocess', "random_resized_crop(224)|flip_lr|normalize('imagenet')",
                    'The preprocessing when config.preprocess is empty: PyTorch\'s transforms.')
flags.DEFINE_integer('make_folder', 0, 'Generate this many JPEGs in ROOT/train first, if ROOT '
                     'does not exist.', lower_bound=0)
flags.DEFINE_bool('torch', True, 'Also time PyTorch (needs torch and torchvision).')
flags.DEFINE_bool('grain', True, 'Also time a Grain pipeline (needs grain and torchvision).')
flags.DEFINE_string('json', None, 'Where to write the figures (optional).')

IMAGE_SIZES = (180, 320)  # Height and width of the generated photos, each.
WORKERS = len(os.sched_getaffinity(0))  # The peers' worker processes: the usable cores.


def app_epochs(config):
  """The image size of this app's training batches, and an iterator of (epoch, images,
  seconds) over them, epoch by epoch."""
  from core import runtime  # pylint: disable=g-import-not-at-top  (after flags, before TF)
  runtime.start()
  import input_pipeline  # pylint: disable=g-import-not-at-top
  from training import run_spec  # pylint: disable=g-import-not-at-top
  run = run_spec.resolve(config)
  data = input_pipeline.open_data(run.input, {})
  split = input_pipeline.open_split(data, input_pipeline.process_split(
      run.input.train_split, drop_remainder=True), run.input)
  steps = data.info.num_train_examples // run.batch_size
  batches = input_pipeline.train_batches(split, data, run.input, run.batch_size)

  def epochs():
    for epoch in range(run.num_epochs):
      start = time.perf_counter()
      for _ in range(steps):
        next(batches)
      yield epoch + 1, steps * run.batch_size, time.perf_counter() - start

  return data.info.image_shape[0], epochs()


def torch_epochs(root: str, split: str, batch_size: int, size: int):
  """Yields (epoch, images, seconds) of PyTorch's DataLoader over root/split, epoch by epoch
  (the first starts the workers)."""
  # pylint: disable=g-import-not-at-top  (optional extras)
  import torch
  from torch.utils import data as torch_data
  from torchvision import datasets
  from torchvision import transforms
  # pylint: enable=g-import-not-at-top
  transform = transforms.Compose([
      transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
      transforms.ToTensor(),
      transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
  folder = datasets.ImageFolder(os.path.join(root, split), transform)
  # Workers from a fork server, kept across epochs: forked from this process, whose TensorFlow
  # and JAX threads may hold locks, a worker can deadlock.
  loader = torch_data.DataLoader(folder, batch_size=batch_size, shuffle=True, drop_last=True,
                                 num_workers=WORKERS,
                                 multiprocessing_context='forkserver', persistent_workers=True,
                                 generator=torch.Generator().manual_seed(0))
  epoch = 0
  while True:
    epoch += 1
    start, images = time.perf_counter(), 0
    for batch, _ in loader:
      images += len(batch)
    yield epoch, images, time.perf_counter() - start


class _PilCrops:
  """torchvision's RandomResizedCrop and flip on a decoded PIL image, as uint8 (a picklable
  Grain transform: Grain's workers are processes)."""

  def __init__(self, size: int):
    from torchvision import transforms  # pylint: disable=g-import-not-at-top  (optional extras)
    self._crops = transforms.Compose([transforms.RandomResizedCrop(size),
                                      transforms.RandomHorizontalFlip()])

  def __call__(self, file: tuple[str, int]) -> tuple:
    from PIL import Image  # pylint: disable=g-import-not-at-top
    path, label = file
    with Image.open(path) as image:
      return np.asarray(self._crops(image.convert('RGB'))), label


def grain_epochs(root: str, split: str, batch_size: int, size: int, epochs: int):
  """Yields (epoch, images, seconds) of a Grain pipeline over root/split, epoch by epoch: file
  names shuffled, decoded by PIL and cropped by torchvision's transforms in Grain's worker
  processes (as many as the usable cores, started once), uint8 batches; epochs follow one
  another in one stream of batches."""
  import grain  # pylint: disable=g-import-not-at-top  (optional)
  folder = os.path.join(root, split)
  classes = sorted(os.listdir(folder))
  files = [(os.path.join(folder, name, file), label) for label, name in enumerate(classes)
           for file in sorted(os.listdir(os.path.join(folder, name)))]
  steps = len(files) // batch_size
  batches = (grain.MapDataset.source(files).shuffle(seed=0).repeat(epochs).map(_PilCrops(size))
             .batch(batch_size, drop_remainder=True,
                    batch_fn=lambda examples: tuple(np.stack(part) for part in zip(*examples)))
             # Each worker makes one batch at a time, up to 2 ahead (PyTorch's prefetch_factor):
             # Grain's default (16 threads, 500 ahead) would fill its buffer while the others run.
             .to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))
             .mp_prefetch(grain.MultiprocessingOptions(
                 num_workers=WORKERS)))
  batches = iter(batches)
  for epoch in range(1, epochs + 1):
    start = time.perf_counter()
    for _ in range(steps):
      next(batches)
    yield epoch, steps * batch_size, time.perf_counter() - start


def main(argv):
  del argv
  config = FLAGS.config
  config.num_epochs = FLAGS.epochs
  if not config.preprocess:
    config.preprocess = FLAGS.preprocess
  root = config.dataset
  if FLAGS.make_folder and not os.path.exists(root):
    generated.make_kind_folder(root, 'digits', num_images=FLAGS.make_folder,
                               image_sizes=IMAGE_SIZES, messy=False, formats=('JPEG',))
  print(harness.machine_line(harness.machine()))
  load_at_start = os.getloadavg()
  print(f'load average at the start: {" ".join(f"{v:.2f}" for v in load_at_start)}')
  print(f'this app: config.preprocess={config.preprocess!r}, batch {config.batch_size}, '
        f'in_memory={config.in_memory!r}, decoded_cache={config.decoded_cache!r}')
  size, ours = app_epochs(config)
  split = config.train_split.split('[')[0]  # The peers read the split's folder whole.
  peers = {}  # name: its epochs, each timed after one of the app's.
  if FLAGS.torch:
    try:
      import torchvision  # pylint: disable=g-import-not-at-top,unused-import
    except ImportError:
      print('PyTorch: not installed (pip install -r requirements-extras.txt): skipped')
    else:
      peers['PyTorch DataLoader'] = torch_epochs(root, split, config.batch_size, size)
      print(f'PyTorch: ImageFolder({root}/{split}), RandomResizedCrop({size}), '
            f'RandomHorizontalFlip, ToTensor, Normalize, DataLoader(num_workers='
            f'{WORKERS})')
  if FLAGS.grain:
    try:
      import grain  # pylint: disable=g-import-not-at-top,unused-import
      import torchvision  # pylint: disable=g-import-not-at-top,unused-import,reimported
    except ImportError:
      print('Grain: grain or torchvision not installed (requirements-extras.txt): skipped')
    else:
      peers['Grain'] = grain_epochs(root, split, config.batch_size, size, config.num_epochs)
      print(f'Grain: MapDataset of {root}/{split} file names, PIL decoding, torchvision\'s '
            f'RandomResizedCrop({size}) and flip, uint8 batches, mp_prefetch(num_workers='
            f'{WORKERS})')
  rows = []

  def report(name: str, images: int, seconds: float) -> None:
    rows.append({'pipeline': name, 'images': images, 'seconds': seconds,
                 'images_per_sec': images / seconds})
    print(f'{name}: {images} images in {seconds:.1f} s, {images / seconds:.0f} images/s',
          flush=True)

  for epoch, images, seconds in ours:
    later = f' (decoded_cache={config.decoded_cache!r})'
    report(f'this app, epoch {epoch}' + (' (decodes the files)' if epoch == 1 else later),
           images, seconds)
    for name, epochs in peers.items():
      peer_epoch, images, seconds = next(epochs)
      report(f'{name}, epoch {peer_epoch}', images, seconds)
  print(f'load average at the end: {" ".join(f"{v:.2f}" for v in os.getloadavg())}')
  rows.sort(key=lambda row: row['pipeline'].startswith('this app'))  # The app's last epoch last.
  for row in rows:
    print(f'{row["pipeline"]}: {row["images_per_sec"]:.0f} images/s')
  if FLAGS.json:
    harness.write_json(FLAGS.json, {
        'preprocess': config.preprocess, 'batch_size': config.batch_size,
        'decoded_cache': config.decoded_cache, 'load_at_start': load_at_start,
        'load_at_end': os.getloadavg(), 'rows': rows})


if __name__ == '__main__':
  app.run(main)
