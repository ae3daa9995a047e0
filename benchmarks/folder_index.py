"""Opening a large image folder: the first open (every header read) vs the next (the index).

    python -m benchmarks.folder_index --root=/tmp/folder_index_100k [--files=100000]

Writes `--files` small PNGs (8x8, `train/<class>/`, 10 classes) under `--root` unless it is
already there, deletes the folder's index, then opens the folder three times, each in a fresh
process (`harness.json_child`): with no index (every header read, the index written), again
(from the index), and after one file was touched (one header read again). For each it prints the
seconds `FolderSource(root)` took, the process's wall time and peak RSS, and the RSS that the
open added to the process after its imports, per file; the open's CPU seconds (all threads) say
more than its wall time on a busy machine (docs/own_data.md). --json writes them
(`harness.write_json`).
"""

import json
import os
import resource
import sys
import time

from core import runtime  # pylint: disable=g-bad-import-order  (first: it must precede tensorflow)

runtime.start()  # As main.py does.

from absl import app
from absl import flags
import numpy as np
from PIL import Image

from benchmarks import harness
from data_sources import folder_source
from data_sources import image_files

FLAGS = flags.FLAGS
flags.DEFINE_string('root', '/tmp/folder_index_100k', 'The image folder (written if absent).')
flags.DEFINE_integer('files', 100_000, 'Number of images to write.')
flags.DEFINE_integer('classes', 10, 'Number of class folders.')
flags.DEFINE_string('json', None, 'Where to write the figures (optional).')
flags.DEFINE_bool('open_once', False, 'Internal: open the folder once and write its figures to '
                  '--json.')
_VARIANTS = 256  # Distinct encoded images, written over and over: encoding each is the slow part.


def _generate(root: str, files: int, classes: int) -> None:
  """`files` 8x8 RGB PNGs in `classes` folders: `_VARIANTS` random images encoded once, written
  round-robin."""
  rng = np.random.default_rng(0)
  variants = []
  for _ in range(_VARIANTS):
    image = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    path = os.path.join(root, 'variant.png')
    os.makedirs(root, exist_ok=True)
    image.save(path)
    with open(path, 'rb') as file:
      variants.append(file.read())
    os.remove(path)
  for index in range(files):
    folder = os.path.join(root, 'train', f'class_{index % classes}')
    if index < classes:
      os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f'{index:07d}.png'), 'wb') as file:
      file.write(variants[index % _VARIANTS])


def _open_once(root: str) -> dict:
  """Opens `root` as training does: the open's seconds, CPU seconds, files and added RSS."""
  before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  start, start_cpu = time.perf_counter(), time.process_time()
  source = folder_source.FolderSource(root)
  seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
  after_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return {'open_s': seconds, 'open_cpu_s': cpu_seconds, 'files': source.num_examples('train'),
          'rss_added_mb': (after_kb - before_kb) / 1024}


def _timed_open(root: str) -> dict:
  """`_open_once` in a fresh process: its figures, the process's wall time and peak RSS."""
  figures, child = harness.json_child(
      [sys.executable, '-m', 'benchmarks.folder_index', f'--root={root}', '--open_once'])
  return {**figures, 'peak_rss_mb': child.peak_rss_mb, 'wall_s': child.seconds}


def main(argv):
  del argv
  if FLAGS.open_once:
    with open(FLAGS.json, 'w', encoding='utf-8') as file:
      json.dump(_open_once(FLAGS.root), file)
    return
  if not os.path.isdir(FLAGS.root):
    start = time.perf_counter()
    _generate(FLAGS.root, FLAGS.files, FLAGS.classes)
    print(f'Wrote {FLAGS.files} PNGs under {FLAGS.root} in {time.perf_counter() - start:.1f}s.')
  index = image_files.index_path(FLAGS.root)
  if os.path.exists(index):
    os.remove(index)
  runs = {'first open (no index)': _timed_open(FLAGS.root)}
  index_mb = os.path.getsize(index) / 2**20
  runs['second open (index)'] = _timed_open(FLAGS.root)
  os.utime(image_files.find_files(os.path.join(FLAGS.root, 'train', 'class_0'))[0])
  runs['one file touched'] = _timed_open(FLAGS.root)
  print(f'Index: {index} ({index_mb:.1f} MB).')
  print(harness.markdown_table(
      ['open', 'files', 'open (s)', 'open, CPU (s)', 'process wall (s)', 'peak RSS (MB)',
       'RSS added by the open (MB)', 'per file (bytes)'],
      [[name, f'{run["files"]:,}', f'{run["open_s"]:.1f}', f'{run["open_cpu_s"]:.1f}',
        f'{run["wall_s"]:.1f}', f'{run["peak_rss_mb"]:,.0f}', f'{run["rss_added_mb"]:.0f}',
        f'{run["rss_added_mb"] * 2**20 / run["files"]:,.0f}'] for name, run in runs.items()],
      align='lrrrrrrr'))
  if FLAGS.json:
    harness.write_json(FLAGS.json, {'root': FLAGS.root, 'index_mb': index_mb, 'runs': runs})


if __name__ == '__main__':
  app.run(main)
