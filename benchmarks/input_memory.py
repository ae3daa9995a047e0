"""Peak RSS and speed of one epoch of training batches without a model: the input pipeline's.

    python -m benchmarks.input_memory --config=configs/default.py --config.in_memory=never \
      --config.train_split='train[:10%]' --config.image_size=64 --config.shuffle_buffer_size=5000

Opens `config.train_split` as training does (`input_pipeline.open_split`: in memory or streamed,
as `config.in_memory` says), reads one epoch of training chunks and prints the number of
examples, the seconds and the process's peak RSS (docs/own_data.md).
"""

import resource
import time

from cli import startup  # pylint: disable=g-bad-import-order  (first: it must precede tensorflow)

startup.tune_malloc_for_cpu()  # As main.py does.

from absl import app
from absl import flags
from ml_collections import config_flags

import data_sources
import input_pipeline

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config whose input to measure.')


def main(argv):
  del argv
  config = FLAGS.config
  config.num_epochs = 1
  start = time.perf_counter()
  split = input_pipeline.open_split(data_sources.open_source(config), config.train_split, config)
  examples = sum(chunk['label'].size for chunk in input_pipeline.train_batches(split, config))
  print(f'{config.train_split!r} in_memory={config.in_memory!r} image_size={config.image_size}: '
        f'{examples} examples in {time.perf_counter() - start:.1f}s, peak RSS '
        f'{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB')


if __name__ == '__main__':
  app.run(main)
