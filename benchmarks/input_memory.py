"""Peak RSS and speed of one epoch of training batches without a model: the input pipeline's.

    python -m benchmarks.input_memory --config=configs/default.py --config.in_memory=never \
      --config.train_split='train[:10%]' --config.preprocess='resize(64)' \
      --config.shuffle_buffer_size=5000

Opens `config.train_split` as training does (`input_pipeline.open_split`: in memory or streamed,
as `config.in_memory` says), reads one epoch of training batches and prints the number of
examples, the seconds and the process's peak RSS (docs/own_data.md); --json writes them
(`harness.write_json`).
"""

import dataclasses
import resource
import time

from core import runtime  # pylint: disable=g-bad-import-order  (first: it must precede tensorflow)

runtime.start()  # As main.py does.

from absl import app
from absl import flags
from ml_collections import config_flags

from benchmarks import harness
import input_pipeline
from training import run_spec

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config whose input to measure.')
flags.DEFINE_string('json', None, 'Where to write the figures (optional).')


def main(argv):
  del argv
  config = FLAGS.config
  start = time.perf_counter()
  run = run_spec.resolve(config)
  # One epoch: set on the resolved input, not on the config, whose warmup_epochs and
  # unmixed_last_epochs are checked against the config's own num_epochs.
  inputs = dataclasses.replace(run.input, num_epochs=1)
  data = input_pipeline.open_data(inputs, run.eval_splits())
  split = input_pipeline.open_split(data, inputs.train_split, inputs)
  examples = sum(batch['label'].size for batch in input_pipeline.train_batches(
      split, data, inputs, run.batch_size))
  seconds = time.perf_counter() - start
  peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(f'{config.train_split!r} in_memory={config.in_memory!r} '
        f'preprocess={config.preprocess!r}: {examples} examples in {seconds:.1f}s, peak RSS '
        f'{peak_rss_mb:.0f} MB')
  if FLAGS.json:
    harness.write_json(FLAGS.json, {'train_split': config.train_split,
                                    'in_memory': config.in_memory,
                                    'preprocess': config.preprocess, 'examples': int(examples),
                                    'seconds': seconds, 'peak_rss_mb': peak_rss_mb})


if __name__ == '__main__':
  app.run(main)
