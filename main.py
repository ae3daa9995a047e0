"""Trains an NNX classifier: `python main.py --config=configs/default.py --workdir=runs/mnist`.

Rerunning the command on the same workdir resumes from its latest checkpoint. On a trained
workdir, `--mode=eval` scores a checkpoint, `--mode=export` writes it as a TF SavedModel (or
ONNX, TFLite, StableHLO or a plug-in format: --export_format) and
`--mode=predict --inputs=PATH` classifies image files (`--mode=embed`: their pooled features);
they read the config the workdir was trained with, so they need only `--workdir`.

Override any config value with `--config.<key>=<value>`, e.g. `--config.learning_rate=0.05`.
On several hosts, start the same command on each: JAX detects SLURM, Open MPI and Cloud TPU
jobs, or pass `--coordinator_address=HOST:PORT --num_processes=N --process_id=I`
(docs/launch.md).
"""

import gc
import os
import sys

from core import runtime  # pylint: disable=g-bad-import-order  (first: it must precede tensorflow)

MALLOC_TUNED = runtime.start(verbose='--verbose' in sys.argv)  # Before TF and JAX start threads.

from absl import app
from absl import flags
from absl import logging
import ml_collections
from ml_collections import config_flags

from core import cli
from core import config_values
from core import errors
from core import saved_config

# TensorFlow, JAX and the app's modules are imported in `main`, once the flags have parsed and
# the config's numbers are checked: a mistyped flag or config key, or a number out of its
# interval, is refused in about a second instead of after ~10 s of imports.

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs', 'default.py')
FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and TensorBoard files.')
cli.define_config(DEFAULT_CONFIG, 'Path to a config file with get_config(). Default: the config '
                  'the workdir was trained with, else configs/default.py.',
                  saved_config.with_defaults)
flags.DEFINE_enum('mode', 'train', ['train', 'eval', 'export', 'predict', 'embed'],
                  'train (resuming from the latest checkpoint), eval (score a checkpoint, with '
                  'a report), export (a checkpoint as a TF SavedModel, or --export_format), '
                  'predict (classify the images of --inputs) or embed (their pooled features, '
                  'a backbone\'s, into embeddings.npy).')
flags.mark_flags_as_required(['workdir'])
flags.DEFINE_string('inputs', None, '--mode=predict/embed: an image file, a directory of images '
                    '(searched recursively), a glob pattern or a CSV file listing images.')
flags.DEFINE_integer('top_k', 1, '--mode=predict: the N most probable classes of each image '
                     '(columns class_1,probability_1,...; 1: file,class,probability).',
                     lower_bound=1)  # Its upper bound, the model's classes, is checked later.
flags.DEFINE_enum('tta', None, config_values.TTA_CHOICES, '--mode=predict: test-time '
                  'augmentation, flip: the mean softmax over each image and its mirror '
                  '(--mode=eval: config.eval_tta).')
flags.DEFINE_string('checkpoint', 'latest', '--mode=eval/export/predict: the checkpoint to use: '
                    'latest, best (best config.best_metric at an epoch end) or a step number.')
# Checked by the export against its registry, which lists the formats in its error: a plug-in
# format registered by a module the config file imports is known only once the flags parse.
flags.DEFINE_string('export_format', None,
                    '--mode=export: the format, saved_model by default, or another of '
                    'modes/export/ or a plug-in (docs/export.md); each with a model card.')
flags.DEFINE_bool('verbose', False, "Show the libraries' start-up notices and INFO lines.")
flags.DEFINE_string('coordinator_address', None,
                    'HOST:PORT of process 0, for a multi-process run (jax.distributed).')
flags.DEFINE_integer('num_processes', None, 'Number of processes of a multi-process run; 1 '
                     'alone: a single process, without cluster detection.')
flags.DEFINE_integer('process_id', None, 'Index of this process, in [0, num_processes).')
flags.DEFINE_string('compilation_cache', runtime.default_compilation_cache(),
                    "Directory of JAX's persistent compilation cache: a rerun, resume or sweep "
                    "trial reads its compiled programs from there ('' turns it off).")


def load_config() -> ml_collections.ConfigDict:
  """The run's config: --config if given; otherwise the workdir's saved config, else
  configs/default.py (either the flag's default, with the --config.<key> overrides applied).
  Eval, export and predict always start from the saved config, even with --config: the
  checkpoint's model and data are its."""
  config = saved_config.with_defaults(FLAGS.workdir) if os.path.isdir(FLAGS.workdir) else None
  if config is None or FLAGS.mode == 'train' or not FLAGS['config'].present:
    return FLAGS.config
  try:
    overrides = config_flags.get_override_values(FLAGS['config'])
    for key, value in overrides.items():
      *parents, name = key.split('.')
      section = config
      for parent in parents:
        section = section[parent]
      section[name] = value
  except (KeyError, AttributeError, TypeError) as error:
    raise errors.FlagError(
        f'A --config.<key> override names no key of the config {FLAGS.workdir} was trained '
        f'with ({error}): set keys it has, or train a new workdir with a config that defines '
        'it.', flag='config', value=str(error)) from None
  return config


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  try:  # Refused before the imports below: a flag alone, a config's numbers.
    if FLAGS.mode in ('predict', 'embed'):
      cli.check_inputs(FLAGS.inputs, FLAGS.mode)
    config = load_config()
    config_values.check(config)
  except errors.UserError as error:
    sys.exit(error.one_line())
  # pylint: disable=g-import-not-at-top  (after the flags: see above)
  import jax
  import tensorflow as tf
  from modes import embed
  from modes import evaluate
  from modes import export
  from modes import predict
  import train
  from training import checkpointing
  from training import parallel
  from training import run_spec
  from training import workdirs
  # pylint: enable=g-import-not-at-top
  runtime.quiet_libraries(FLAGS.verbose)
  runtime.use_compilation_cache(FLAGS.compilation_cache)
  # TensorFlow only feeds data; keep it off the GPUs so JAX gets all their memory.
  tf.config.set_visible_devices([], 'GPU')
  try:
    parallel.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    logging.info('JAX process %d of %d, local devices: %s; malloc tuned for XLA:CPU: %s',
                 jax.process_index(), jax.process_count(), jax.local_devices(), MALLOC_TUNED)
    run = run_spec.resolve(config)
    if FLAGS.mode == 'train':
      with workdirs.hold(FLAGS.workdir):  # One training run per workdir.
        train.train_and_evaluate(run, FLAGS.workdir)
    elif FLAGS.mode == 'eval':  # Eval, export and predict only read the workdir.
      evaluate.evaluate_checkpoint(run, FLAGS.workdir, FLAGS.checkpoint)
    elif FLAGS.mode == 'export':
      export.export(run, FLAGS.workdir, FLAGS.export_format or export.DEFAULT_FORMAT,
                    FLAGS.checkpoint)
    elif FLAGS.mode == 'embed':
      embed.embed(run, FLAGS.workdir, FLAGS.inputs, FLAGS.checkpoint)
    else:
      predict.predict(run, FLAGS.workdir, FLAGS.inputs, FLAGS.checkpoint, FLAGS.top_k,
                      FLAGS.tta)
  except errors.UserError as error:
    sys.exit(error.one_line())
  except runtime.Interrupted as error:
    logging.warning('%s', error)
    sys.exit(128 + error.signum)  # The shell convention for "stopped by this signal".
  except Exception as error:  # pylint: disable=broad-except  (re-raised unless an OS error)
    # A full disk or lost permissions, met by a summary write: not a bug.
    if (reason := checkpointing.io_failure(error)) is None:
      raise
    sys.exit(errors.StorageError(
        f'{reason} while writing to {FLAGS.workdir}: free some space (or fix the permissions) '
        'and rerun the same command; the checkpoints saved so far are kept.',
        path=FLAGS.workdir, reason=reason).one_line())
  finally:
    # The interpreter's last garbage collections at exit walk every object TensorFlow created
    # (~2 s on 2 cores); the run has closed its writers and checkpoints, so they are skipped.
    gc.freeze()


if __name__ == '__main__':
  app.run(main, flags_parser=cli.parse_flags)
