r"""Runs a hyperparameter sweep, one `main.py` run per point, then a results table.

A grid (the default) runs the product of the values:

  python sweep.py --config=configs/default.py --workdir=runs/lr_sweep \
      --sweep='learning_rate=0.01,0.05,0.1' --sweep='batch_size=64,128' --config.num_epochs=3

each in `<workdir>/<key>=<value>,...`. A random or TPE search (Optuna) samples ranges instead:

  python sweep.py --config=configs/default.py --workdir=runs/lr_search --search=tpe \
      --num_trials=12 --sweep='learning_rate=loguniform(0.01,0.5)' \
      --sweep='momentum=uniform(0.5,0.95)' --prune

each trial in `<workdir>/trial_<number>` (sweeps/search.py; the ranges: sweeps/spec.py). Keys
come from the `--sweep` flags and a `get_sweep()` in the config file (configs/lr_sweep.py,
configs/lr_search.py); the `--config.<key>=<value>` overrides apply to every run. The whole spec
is checked before the first run starts.

Rerunning the same command skips finished runs and resumes the others in their own workdirs,
where `main.py` picks up whatever an interrupted run left there; a search rerun with a larger
--num_trials adds trials. A SIGTERM or Ctrl-C stops every running main.py at a checkpoint. At the
end, the runs, best first, are printed and written to `<workdir>/sweep_results.{csv,md}`.
"""

import concurrent.futures
import dataclasses
import glob
import itertools
import json
import os
import signal
import sys
import time

from cli import startup  # pylint: disable=g-bad-import-order  (first: it must precede tensorflow)

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from sweeps import runs
from sweeps import search
from sweeps import spec
from training import config_checks

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'Sweep directory: one subdirectory per run, and the results.')
config_flags.DEFINE_config_file('config', None, 'Path to a config file with get_config().',
                                lock_config=True)
flags.DEFINE_multi_string('sweep', [], "'key=value1,value2,...' (values of config.<key>), or for "
                          "a random/TPE search a range: 'key=uniform(a,b)', loguniform(a,b), "
                          'int(a,b) or choice(v1,v2,...). Repeat the flag for several keys.')
flags.DEFINE_enum('search', 'grid', ['grid', 'random', 'tpe'],
                  'grid: every combination of the values; random or tpe: --num_trials trials '
                  "sampled by Optuna's RandomSampler or TPESampler.")
flags.DEFINE_integer('num_trials', None, 'Trials of a random/TPE search, in all (a rerun with '
                     'more adds trials to the study).', lower_bound=1)
flags.DEFINE_bool('prune', False, "Random/TPE search: stop trials whose per-epoch metric is "
                  "worse than the median of earlier trials' (Optuna's MedianPruner).")
flags.DEFINE_integer('startup_trials', 5, 'Random/TPE search: trials before TPE models the results '
                     'and before pruning starts.', lower_bound=0)
flags.DEFINE_integer('search_seed', 0, 'Seed of the random/TPE sampler.')
flags.DEFINE_integer('parallel', 1, 'Runs at the same time.', lower_bound=1)
flags.mark_flags_as_required(['config', 'workdir'])

DONE_FILE = 'sweep_run.json'  # Written in a grid's run dir once its run has finished successfully.


@dataclasses.dataclass(frozen=True)
class Run:
  """One run of the grid: its directory name and `--config.*` flags of main.py."""
  name: str
  args: tuple[str, ...]


def plan_runs(config_file: str, overrides: dict[str, str],
              sweep: dict[str, spec.Values]) -> list[Run]:
  """Every run of the grid `sweep` (product of its values), each with `overrides`, all checked.

  Raises SweepError, before anything runs, for an unknown key, a range, an empty or repeated
  value, a value that does not parse as its key's type, or a config that check_config rejects.
  """
  if not sweep:
    raise spec.SweepError("Nothing to sweep: pass --sweep='key=value1,value2' or define "
                          f'get_sweep() in {config_file}.')
  config = spec.resolve_config(config_file, ())
  for key, values in sweep.items():
    spec.check_key(config, key, values, overrides)
    if isinstance(values, spec.Range):
      raise spec.SweepError(f"Sweep of {key!r} is a range, {values}: a grid runs lists of values "
                            f"('{key}=v1,v2,...'); search ranges with --search=random or "
                            '--search=tpe.')
  base_args = spec.override_args(overrides)
  planned = []
  for combination in itertools.product(*[[(key, value) for value in values]
                                         for key, values in sweep.items()]):
    run = Run(name=','.join(f'{key}={value}' for key, value in combination).replace('/', '_'),
              args=base_args + tuple(f'--config.{key}={value}' for key, value in combination))
    try:
      config_checks.check_config(spec.resolve_config(config_file, run.args))
    except (flags.Error, config_checks.ConfigError) as error:
      raise spec.SweepError(f'Run {run.name!r}: {error}') from error
    planned.append(run)
  return planned


def execute(run: Run, config_file: str, workdir: str, launcher: runs.Launcher,
            metric: str) -> dict | None:
  """Runs main.py for `run` unless it has finished; returns its results, None if it failed."""
  run_dir = os.path.join(workdir, run.name)
  done_file = os.path.join(run_dir, DONE_FILE)
  if os.path.exists(done_file):
    with open(done_file) as f:
      return json.load(f)
  start = time.time()
  if launcher.run(run.name, run_dir, run.args) != 0:
    return None
  result = {'run': run.name, 'overrides': ' '.join(run.args), 'config': config_file,
            **runs.summarize(run_dir, metric), 'wall_time_s': round(time.time() - start, 1)}
  with open(done_file, 'w') as f:
    json.dump(result, f, indent=2)
  logging.info('Run %s: finished in %.0fs, best %s %.4f', run.name, result['wall_time_s'],
               metric, result[f'best_{metric}'])
  return result


def check_finished_runs(planned: list[Run], config_file: str, workdir: str) -> list[Run]:
  """The runs that still have to run; fails if a finished one ran with other settings."""
  if os.path.exists(os.path.join(workdir, search.STUDY_FILE)):
    raise spec.SweepError(f'{workdir} holds a random/TPE search ({search.STUDY_FILE}): rerun it '
                          'with its --search flag, or use another --workdir for the grid.')
  pending = []
  for run in planned:
    done_file = os.path.join(workdir, run.name, DONE_FILE)
    if not os.path.exists(done_file):
      pending.append(run)
      continue
    with open(done_file) as f:
      done = json.load(f)
    if (done['config'], done['overrides']) != (config_file, ' '.join(run.args)):
      raise spec.SweepError(
          f'Run {run.name!r} in {workdir} finished with --config={done["config"]} '
          f'{done["overrides"]}, not with the settings of this sweep: use another --workdir, or '
          'delete that run dir to rerun it.')
  return pending


def run_grid(config_file: str, overrides: dict[str, str], sweep: dict[str, spec.Values],
             launcher: runs.Launcher, metric: str) -> tuple[list[dict], list[str], list[str]]:
  """Runs the grid; returns the results, the table's columns and the failed runs."""
  planned = plan_runs(config_file, overrides, sweep)
  config_checks.check_workdir(FLAGS.workdir)
  with runs.hold(FLAGS.workdir):
    pending = check_finished_runs(planned, config_file, FLAGS.workdir)
    logging.info('Sweep of %d runs in %s: %d finished, %d to run, %d at a time.', len(planned),
                 FLAGS.workdir, len(planned) - len(pending), len(pending), FLAGS.parallel)
    with concurrent.futures.ThreadPoolExecutor(FLAGS.parallel) as pool:
      results = list(pool.map(
          lambda run: execute(run, config_file, FLAGS.workdir, launcher, metric), planned))
  finished = [result for result in results if result]
  columns = ['run', 'overrides', f'best_{metric}', f'final_{metric}', 'epochs', 'wall_time_s']
  if any('test_accuracy' in result for result in finished):
    columns.append('test_accuracy')
  return finished, columns, [run.name for run, result in zip(planned, results) if not result]


def run_search(config_file: str, overrides: dict[str, str], sweep: dict[str, spec.Values],
               launcher: runs.Launcher, metric: str) -> tuple[list[dict], list[str], list[str]]:
  """Runs the random/TPE search; returns every trial, the table's columns and the failed ones."""
  if FLAGS.num_trials is None:
    raise spec.SweepError(f'--search={FLAGS.search} needs --num_trials=N (trials in all).')
  space = spec.search_space(config_file, overrides, sweep)
  config_checks.check_workdir(FLAGS.workdir)
  if grid_runs := glob.glob(os.path.join(glob.escape(FLAGS.workdir), '*', DONE_FILE)):
    raise spec.SweepError(f'{FLAGS.workdir} holds a grid sweep ({os.path.dirname(grid_runs[0])})'
                          ': use another --workdir for the search.')
  settings = {'config': config_file, 'overrides': ' '.join(spec.override_args(overrides)),
              'search': FLAGS.search, 'metric': metric,
              'space': {key: str(values) if isinstance(values, spec.Range) else ','.join(values)
                        for key, values in sweep.items()}}
  with runs.hold(FLAGS.workdir):
    study = search.open_study(FLAGS.workdir, settings, FLAGS.search, FLAGS.search_seed,
                              FLAGS.startup_trials, FLAGS.prune)
    search.run_trials(study, space, FLAGS.num_trials, FLAGS.parallel, launcher, config_file,
                      spec.override_args(overrides), FLAGS.workdir, metric)
  rows, columns = search.results(study, space, metric)
  return rows, columns, [row['run'] for row in rows if row['state'] == 'failed']


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  config_file = config_flags.get_config_filename(FLAGS['config'])
  overrides = {key: str(value)
               for key, value in config_flags.get_override_values(FLAGS['config']).items()}
  env = dict(os.environ)
  if FLAGS.parallel > 1:  # Runs sharing an accelerator must not each grab 75% of its memory.
    env.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  launcher = runs.Launcher(config_file, env)
  metric = FLAGS.config.get('best_metric', 'eval_accuracy')
  try:
    sweep = {**spec.sweep_from_config_file(config_file), **spec.parse_sweep_flags(FLAGS.sweep)}
    if FLAGS.search == 'grid' and (FLAGS.num_trials is not None or FLAGS.prune):
      raise spec.SweepError('--num_trials and --prune are for --search=random or tpe; a grid '
                            'runs every combination of its values.')
    for signum in (signal.SIGTERM, signal.SIGINT):
      signal.signal(signum, launcher.stop)
    rows, columns, failed = (run_grid if FLAGS.search == 'grid' else run_search)(
        config_file, overrides, sweep, launcher, metric)
  except config_checks.ConfigError as error:
    sys.exit(f'Sweep error: {error}')

  if rows:
    print(runs.write_results(rows, columns, metric, FLAGS.workdir), end='')
  if launcher.stopped_by:
    logging.warning('Stopped by %s: rerun the same command to resume.',
                    signal.Signals(launcher.stopped_by).name)
    sys.exit(128 + launcher.stopped_by)
  if FLAGS.search == 'grid' and failed:
    sys.exit(f'{len(failed)} of {len(rows) + len(failed)} runs failed: {", ".join(failed)}; '
             'rerun the same command to retry them.')
  if failed:
    if len(failed) == len(rows):
      sys.exit(f'All {len(rows)} trials failed: see main.log in {", ".join(failed)}.')
    logging.warning('%d of %d trials failed (see main.log in %s); they are not rerun.',
                    len(failed), len(rows), ', '.join(failed))


if __name__ == '__main__':
  app.run(main, flags_parser=startup.parse_flags)
