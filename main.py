"""Trains an NNX classifier: `python main.py --config=configs/default.py --workdir=runs/mnist`.

Rerunning the command on the same workdir resumes from its latest checkpoint. `--mode=eval`
evaluates that checkpoint; `--mode=export` writes it as a TF SavedModel to <workdir>/export;
`--mode=predict --inputs=PATH` classifies image files into <workdir>/predictions.csv.

Override any config value with `--config.<key>=<value>`, e.g. `--config.learning_rate=0.05`.
On several hosts, run the same command on each with `--coordinator_address=HOST:PORT
--num_processes=N --process_id=I` (see README.md).
"""

import contextlib
import functools
import gc
import sys

from cli import startup  # pylint: disable=g-bad-import-order  (first: it must precede tensorflow)

MALLOC_TUNED = startup.tune_malloc_for_cpu()  # Before TensorFlow and JAX start their threads.

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags
import tensorflow as tf

from data_sources import base
from modes import evaluate
from modes import export
from modes import predict
import train
from training import checkpointing
from training import config_checks
from training import parallel
from training import workdirs

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'Directory for TensorBoard summaries and checkpoints.')
config_flags.DEFINE_config_file('config', None, 'Path to a config file with get_config().',
                                lock_config=True)
flags.DEFINE_enum('mode', 'train', ['train', 'eval', 'export', 'predict'],
                  'train (resuming from the latest checkpoint), eval (the latest checkpoint), '
                  'export (the latest checkpoint as a TF SavedModel) or predict (classify the '
                  'images of --inputs with the latest checkpoint).')
flags.mark_flags_as_required(['config', 'workdir'])
flags.DEFINE_string('inputs', None, '--mode=predict: an image file, a directory of images '
                    '(searched recursively) or a glob pattern.')
flags.DEFINE_string('checkpoint', 'latest', '--mode=eval/export/predict: the checkpoint to use: '
                    'latest, best (best config.best_metric at an epoch end) or a step number.')
flags.DEFINE_string('coordinator_address', None,
                    'HOST:PORT of process 0, for a multi-process run (jax.distributed).')
flags.DEFINE_integer('num_processes', None, 'Number of processes of a multi-process run.')
flags.DEFINE_integer('process_id', None, 'Index of this process, in [0, num_processes).')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  try:
    parallel.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  except ValueError as error:
    sys.exit(f'Flag error: {error}')
  # TensorFlow only feeds data; keep it off the GPUs so JAX gets all their memory.
  tf.config.set_visible_devices([], 'GPU')
  logging.info('JAX process %d of %d, local devices: %s; malloc tuned for XLA:CPU: %s',
               jax.process_index(), jax.process_count(), jax.local_devices(), MALLOC_TUNED)
  run = {'train': train.train_and_evaluate,
         'eval': functools.partial(evaluate.evaluate_checkpoint, checkpoint=FLAGS.checkpoint),
         'export': functools.partial(export.export_saved_model, checkpoint=FLAGS.checkpoint),
         'predict': functools.partial(predict.predict, inputs=FLAGS.inputs,
                                      checkpoint=FLAGS.checkpoint)}[FLAGS.mode]
  # One training run per workdir; eval and export only read it, so they may run beside it.
  hold = workdirs.hold if FLAGS.mode == 'train' else contextlib.nullcontext
  try:
    with hold(FLAGS.workdir):
      run(FLAGS.config, FLAGS.workdir)
  except config_checks.ConfigError as error:
    sys.exit(f'Config error: {error}')
  except base.DataError as error:
    sys.exit(f'Data error: {error}')
  except checkpointing.NonFiniteError as error:
    sys.exit(f'Training halted: {error}')
  except checkpointing.Interrupted as error:
    logging.warning('%s', error)
    sys.exit(128 + error.signum)  # The shell convention for "stopped by this signal".
  except Exception as error:  # pylint: disable=broad-except  (re-raised unless an OS error)
    # A full disk or lost permissions, met by a checkpoint or summary write: not a bug.
    if (reason := checkpointing.io_failure(error)) is None:
      raise
    if isinstance(error, checkpointing.SaveError):
      sys.exit(f'I/O error: {error}')
    sys.exit(f'I/O error: {reason} while writing to {FLAGS.workdir}: free some space (or fix '
             'the permissions) and rerun the same command; the checkpoints saved so far are kept.')
  finally:
    # The interpreter's last garbage collections at exit walk every object TensorFlow created
    # (~2 s on 2 cores); the run has closed its writers and checkpoints, so they are skipped.
    gc.freeze()


if __name__ == '__main__':
  app.run(main, flags_parser=startup.parse_flags)
