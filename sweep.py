r"""Runs a hyperparameter sweep, one `main.py` run per trial, then a results table.

A grid (the default) runs the product of the values:

  python sweep.py --config=configs/default.py --workdir=runs/lr_sweep \
      --sweep='learning_rate=0.01,0.05,0.1' --sweep='batch_size=64,128' --config.num_epochs=3

A random or TPE search samples ranges instead:

  python sweep.py --config=configs/default.py --workdir=runs/lr_search --search=tpe \
      --num_trials=12 --sweep='learning_rate=loguniform(0.01,0.5)' \
      --sweep='optimizer_options.sgd.momentum=uniform(0.5,0.95)' --prune

All three are one Optuna study in `<workdir>/optuna_journal.log`, trial N in
`<workdir>/trial_<N>` (sweeps/engine.py; the ranges: sweeps/spec.py). Keys come from the
`--sweep` flags and a `get_sweep()` in the config file (configs/lr_sweep.py,
configs/lr_search.py); the `--config.<key>=<value>` overrides apply to every run. The whole spec
is checked before the first run starts.

Rerunning the same command skips finished trials and resumes the interrupted ones in their own
directories, where `main.py` picks up whatever an interrupted run left there; a search rerun
with a larger --num_trials adds trials. A SIGTERM or Ctrl-C stops every running main.py at a
checkpoint. At the end, the trials, best first, are printed and written to
`<workdir>/sweep_results.{csv,md}`.
"""

import os
import signal
import sys

from core import runtime  # pylint: disable=g-bad-import-order  (first: it must precede tensorflow)

runtime.start()

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from core import cli
from core import errors
from sweeps import runs

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'Sweep directory: one subdirectory per trial, the study '
                    'and the results.')
config_flags.DEFINE_config_file('config', None, 'Path to a config file with get_config().',
                                lock_config=True)
flags.DEFINE_multi_string('sweep', [], "'key=value1,value2,...' (values of config.<key>), or for "
                          "a random/TPE search a range: 'key=uniform(a,b)', loguniform(a,b), "
                          'int(a,b) or choice(v1,v2,...). Repeat the flag for several keys.')
flags.DEFINE_enum('search', 'grid', ['grid', 'random', 'tpe'],
                  "grid: every combination of the values (Optuna's GridSampler); random or tpe: "
                  "--num_trials trials sampled by Optuna's RandomSampler or TPESampler.")
flags.DEFINE_integer('num_trials', None, 'Trials of a random/TPE search, in all (a rerun with '
                     'more adds trials to the study).', lower_bound=1)
flags.DEFINE_bool('prune', False, "Stop trials whose per-epoch metric is worse than the median "
                  "of earlier trials' (Optuna's MedianPruner).")
flags.DEFINE_integer('startup_trials', 5, 'Trials before TPE models the results, and complete '
                     'trials before pruning starts.', lower_bound=0)
flags.DEFINE_integer('search_seed', 0, 'Seed of the random/TPE sampler.')
flags.DEFINE_integer('parallel', 1, 'Runs at the same time.', lower_bound=1)
flags.mark_flags_as_required(['config', 'workdir'])


def search_flags_error() -> str | None:
  """What is wrong with --search and --num_trials together, if anything. Checked before the
  modules that import TensorFlow and JAX (seconds) are imported."""
  if FLAGS.search == 'grid' and FLAGS.num_trials is not None:
    return ('--num_trials is for --search=random or tpe; a grid runs every combination of its '
            'values.')
  if FLAGS.search != 'grid' and FLAGS.num_trials is None:
    return f'--search={FLAGS.search} needs --num_trials=N (trials in all).'
  return None


def run_sweep(config_file: str, overrides: dict[str, str], launcher: runs.Launcher):
  """Checks the sweep, then runs its study in FLAGS.workdir; returns the study and its space."""
  # pylint: disable=g-import-not-at-top  (after search_flags_error: these import TensorFlow)
  from sweeps import engine
  from sweeps import spec
  from training import run_spec
  from training import workdirs
  # pylint: enable=g-import-not-at-top
  sweep = {**spec.sweep_from_config_file(config_file), **spec.parse_sweep_flags(FLAGS.sweep)}
  grid = FLAGS.search == 'grid'
  space = spec.search_space(config_file, overrides, sweep, grid)
  best = run_spec.resolve(FLAGS.config).best
  settings = {'config': config_file, 'overrides': ' '.join(spec.args(overrides)),
              'search': FLAGS.search, 'metric': best.name,
              'space': {key: str(values) if isinstance(values, spec.Range) else ','.join(values)
                        for key, values in sweep.items()}}
  with workdirs.hold(FLAGS.workdir):  # One sweep per workdir: another would rerun its trials.
    study = engine.open_study(FLAGS.workdir, settings, space, best.maximize, FLAGS.search_seed,
                              FLAGS.startup_trials, FLAGS.prune)
    engine.run_trials(study, space, FLAGS.num_trials, FLAGS.parallel, launcher, config_file,
                      spec.args(overrides), FLAGS.workdir)
  return study, space


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if error := search_flags_error():
    sys.exit(f'Sweep error: {error}')
  config_file = config_flags.get_config_filename(FLAGS['config'])
  overrides = {key: str(value)
               for key, value in config_flags.get_override_values(FLAGS['config']).items()}
  env = dict(os.environ)
  if FLAGS.parallel > 1:  # Runs sharing an accelerator must not each grab 75% of its memory.
    env.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  launcher = runs.Launcher(config_file, env)
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, launcher.stop)
  try:
    study, space = run_sweep(config_file, overrides, launcher)
  except errors.UserError as error:
    sys.exit(error.one_line())

  from sweeps import engine  # pylint: disable=g-import-not-at-top  (imported by run_sweep)
  rows, columns = engine.results(study, space)
  if rows:
    print(runs.write_results(rows, columns, study.user_attrs['sweep']['metric'],
                             engine.maximizes(study), FLAGS.workdir), end='')
  if launcher.stopped_by:
    logging.warning('Stopped by %s: rerun the same command to resume.',
                    signal.Signals(launcher.stopped_by).name)
    sys.exit(128 + launcher.stopped_by)
  if failed := [row['run'] for row in rows if row['state'] == 'failed']:
    if len(failed) == len(rows):
      sys.exit(f'All {len(rows)} trials failed: see main.log in {", ".join(failed)}.')
    logging.warning('%d of %d trials failed (see main.log in %s); they are not rerun.',
                    len(failed), len(rows), ', '.join(failed))


if __name__ == '__main__':
  app.run(main, flags_parser=cli.parse_flags)
