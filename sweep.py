r"""Runs a hyperparameter sweep: one `main.py` run per combination of values, then a results table.

  python sweep.py --config=configs/default.py --workdir=runs/lr_sweep \
      --sweep='learning_rate=0.01,0.05,0.1' --sweep='batch_size=64,128' --config.num_epochs=3

runs the product of the `--sweep` values (and of those of a `get_sweep()` in the config file,
see configs/lr_sweep.py), each in `<workdir>/<key>=<value>,...` with the `--config.<key>=<value>`
overrides applied to every run. The whole spec is checked before the first run starts.

A run is finished once `main.py` exited successfully and sweep.py wrote its results to
`<run dir>/sweep_run.json`. Rerunning a sweep skips finished runs and reruns the others in their
own workdirs, where `main.py` picks up whatever an interrupted run left there. At the end, the
runs sorted by best eval accuracy are printed and written to `<workdir>/sweep_results.{csv,md}`.
"""

import concurrent.futures
import csv
import dataclasses
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import time

from cli import startup  # pylint: disable=g-bad-import-order  (first: it must precede tensorflow)

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags
from tensorboard.backend.event_processing import event_accumulator
import tensorflow as tf

from training import config_checks

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'Sweep directory: one subdirectory per run, and the results.')
config_flags.DEFINE_config_file('config', None, 'Path to a config file with get_config().',
                                lock_config=True)
flags.DEFINE_multi_string('sweep', [], "'key=value1,value2,...': values of config.<key> to run; "
                          'repeat the flag to run the product of several keys.')
flags.DEFINE_integer('parallel', 1, 'Runs at the same time.', lower_bound=1)
flags.mark_flags_as_required(['config', 'workdir'])

MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'main.py')
DONE_FILE = 'sweep_run.json'  # Written in a run dir once its run has finished successfully.
COLUMNS = ('run', 'overrides', 'best_eval_accuracy', 'final_eval_accuracy', 'epochs',
           'wall_time_s')


class SweepError(config_checks.ConfigError):
  """A sweep spec or sweep workdir that cannot work; the message names the problem."""


@dataclasses.dataclass(frozen=True)
class Run:
  """One run of the sweep: its directory name and `--config.*` flags of main.py."""
  name: str
  args: tuple[str, ...]


def parse_sweep_flags(specs: list[str]) -> dict[str, list[str]]:
  """{'key': ['value1', ...]} from --sweep='key=value1,...' flags."""
  sweep = {}
  for spec in specs:
    key, sep, values = spec.partition('=')
    if not sep or not key:
      raise SweepError(f"--sweep={spec!r} is not of the form 'key=value1,value2,...'.")
    if key in sweep:
      raise SweepError(f'--sweep gives {key!r} twice: put all its values in one flag.')
    sweep[key] = values.split(',') if values else []
  return sweep


def sweep_from_config_file(config_file: str) -> dict[str, list[str]]:
  """The `get_sweep()` of the config file ({'key': [values]}), or {} when it has none."""
  path = config_file.split(':')[0]  # 'file.py:arg' passes arg to get_config().
  spec = importlib.util.spec_from_file_location('sweep_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, 'get_sweep'):
    return {}
  return {key: [str(value) for value in values] for key, values in module.get_sweep().items()}


def resolve_config(config_file: str, args: tuple[str, ...]):
  """The config main.py builds from `--config=config_file` and `args`, by the same flag parser."""
  argv = ['main.py', f'--config={config_file}', *args]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', flag_values=flag_values, sys_argv=argv)
  flag_values(argv)
  return flag_values.config


def _has_key(config, dotted_key: str) -> bool:
  """Whether `config` has `dotted_key`, such as 'learning_rate' or 'model_options.cnn.x'."""
  for key in dotted_key.split('.'):
    if not hasattr(config, 'keys') or key not in config:
      return False
    config = config[key]
  return True


def plan_runs(config_file: str, overrides: dict[str, str],
              sweep: dict[str, list[str]]) -> list[Run]:
  """Every run of `sweep` (product of its values), each with `overrides`, all checked.

  Raises SweepError, before anything runs, for an unknown key, an empty or repeated value, a
  value that does not parse as its key's type, or a resulting config that check_config rejects.
  """
  if not sweep:
    raise SweepError("Nothing to sweep: pass --sweep='key=value1,value2' or define get_sweep() "
                     f'in {config_file}.')
  config = resolve_config(config_file, ())
  for key, values in sweep.items():
    if not _has_key(config, key):
      raise SweepError(f'Sweep key {key!r} is not in the config; valid keys: '
                       f'{", ".join(sorted(config))} (nested ones with dots, such as '
                       "'model_options.cnn.dropout_rate').")
    if key in overrides:
      raise SweepError(f'config.{key} is both swept and set by --config.{key}: drop one.')
    if not values or '' in values:
      raise SweepError(f'Sweep of {key!r} has an empty value list or an empty value: '
                       f"{','.join(values)!r}; give values like '{key}=a,b'.")
    if len(set(values)) < len(values):
      raise SweepError(f'Sweep of {key!r} repeats a value: {values}.')
  base_args = tuple(f'--config.{key}={value}' for key, value in overrides.items())
  runs = []
  for combination in itertools.product(*[[(key, value) for value in values]
                                         for key, values in sweep.items()]):
    run = Run(name=','.join(f'{key}={value}' for key, value in combination).replace('/', '_'),
              args=base_args + tuple(f'--config.{key}={value}' for key, value in combination))
    try:
      config_checks.check_config(resolve_config(config_file, run.args))
    except (flags.Error, config_checks.ConfigError) as error:
      raise SweepError(f'Run {run.name!r}: {error}') from error
    runs.append(run)
  return runs


def eval_accuracies(run_dir: str) -> list[float]:
  """The eval_accuracy of every eval of the run in `run_dir`, by step (the last write wins)."""
  accumulator = event_accumulator.EventAccumulator(run_dir, size_guidance={'tensors': 0})
  accumulator.Reload()
  if 'eval_accuracy' not in accumulator.Tags()['tensors']:
    return []
  by_step = {event.step: float(tf.make_ndarray(event.tensor_proto))
             for event in sorted(accumulator.Tensors('eval_accuracy'), key=lambda e: e.wall_time)}
  return [by_step[step] for step in sorted(by_step)]


def execute(run: Run, config_file: str, workdir: str, env: dict[str, str]) -> dict | None:
  """Runs main.py for `run` unless it has finished; returns its results, None if it failed."""
  run_dir = os.path.join(workdir, run.name)
  done_file = os.path.join(run_dir, DONE_FILE)
  if os.path.exists(done_file):
    with open(done_file) as f:
      return json.load(f)
  os.makedirs(run_dir, exist_ok=True)
  log_file = os.path.join(run_dir, 'main.log')
  logging.info('Run %s: started, log in %s', run.name, log_file)
  start = time.time()
  with open(log_file, 'a') as log:
    returncode = subprocess.run(
        [sys.executable, MAIN, f'--config={config_file}', f'--workdir={run_dir}', *run.args],
        stdout=log, stderr=subprocess.STDOUT, env=env, check=False).returncode
  if returncode:
    with open(log_file) as log:
      tail = ''.join(log.readlines()[-15:])
    logging.error('Run %s failed (exit %d); end of %s:\n%s', run.name, returncode, log_file, tail)
    return None
  accuracies = eval_accuracies(run_dir)
  result = {'run': run.name, 'overrides': ' '.join(run.args), 'config': config_file,
            'best_eval_accuracy': max(accuracies), 'final_eval_accuracy': accuracies[-1],
            'epochs': len(accuracies), 'wall_time_s': round(time.time() - start, 1)}
  with open(done_file, 'w') as f:
    json.dump(result, f, indent=2)
  logging.info('Run %s: finished in %.0fs, best eval_accuracy %.4f', run.name,
               result['wall_time_s'], result['best_eval_accuracy'])
  return result


def check_finished_runs(runs: list[Run], config_file: str, workdir: str) -> list[Run]:
  """The runs that still have to run; fails if a finished one ran with other settings."""
  pending = []
  for run in runs:
    done_file = os.path.join(workdir, run.name, DONE_FILE)
    if not os.path.exists(done_file):
      pending.append(run)
      continue
    with open(done_file) as f:
      done = json.load(f)
    if (done['config'], done['overrides']) != (config_file, ' '.join(run.args)):
      raise SweepError(f'Run {run.name!r} in {workdir} finished with --config={done["config"]} '
                       f'{done["overrides"]}, not with the settings of this sweep: use another '
                       '--workdir, or delete that run dir to rerun it.')
  return pending


def write_results(results: list[dict], workdir: str) -> str:
  """Writes `results`, best first, as sweep_results.csv and .md; returns the markdown table."""
  results = sorted(results, key=lambda result: -result['best_eval_accuracy'])
  with open(os.path.join(workdir, 'sweep_results.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, COLUMNS, extrasaction='ignore')
    writer.writeheader()
    writer.writerows(results)
  rows = [COLUMNS, ('---',) * len(COLUMNS)]
  rows += [tuple(f'{result[column]:.4f}' if 'accuracy' in column else str(result[column])
                 for column in COLUMNS) for result in results]
  table = '\n'.join('| ' + ' | '.join(row) + ' |' for row in rows) + '\n'
  with open(os.path.join(workdir, 'sweep_results.md'), 'w') as f:
    f.write(table)
  return table


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  config_file = config_flags.get_config_filename(FLAGS['config'])
  overrides = {key: str(value)
               for key, value in config_flags.get_override_values(FLAGS['config']).items()}
  try:
    runs = plan_runs(config_file, overrides,
                     {**sweep_from_config_file(config_file), **parse_sweep_flags(FLAGS.sweep)})
    config_checks.check_workdir(FLAGS.workdir)
    pending = check_finished_runs(runs, config_file, FLAGS.workdir)
  except config_checks.ConfigError as error:
    sys.exit(f'Sweep error: {error}')

  logging.info('Sweep of %d runs in %s: %d finished, %d to run, %d at a time.', len(runs),
               FLAGS.workdir, len(runs) - len(pending), len(pending), FLAGS.parallel)
  env = dict(os.environ)
  if FLAGS.parallel > 1:  # Runs sharing an accelerator must not each grab 75% of its memory.
    env.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  with concurrent.futures.ThreadPoolExecutor(FLAGS.parallel) as pool:
    results = list(pool.map(lambda run: execute(run, config_file, FLAGS.workdir, env), runs))

  finished = [result for result in results if result]
  if finished:
    print(write_results(finished, FLAGS.workdir), end='')
  failed = [run.name for run, result in zip(runs, results) if not result]
  if failed:
    sys.exit(f'{len(failed)} of {len(runs)} runs failed: {", ".join(failed)}; rerun the same '
             'command to retry them.')


if __name__ == '__main__':
  app.run(main, flags_parser=startup.parse_flags)
