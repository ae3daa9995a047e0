"""Random and TPE search with Optuna's ask/tell interface: one main.py run per trial.

The study lives in <workdir>/optuna_journal.log (Optuna's journal file storage); trial N runs in
<workdir>/trial_000N. A trial left running by a stopped or killed sweep is resumed by the next
sweep in its own directory, where main.py continues from the checkpoint it left. With pruning,
each epoch's metric is reported to Optuna's median pruner while main.py runs; a trial it judges
unpromising after any epoch but the last is recorded as pruned, and its run, if still going, gets
a SIGTERM (it saves a checkpoint and exits).
"""

import concurrent.futures
import os
import threading
import time

from absl import logging
import numpy as np
import optuna
from optuna.trial import TrialState

from sweeps import runs
from sweeps import spec

STUDY_FILE = 'optuna_journal.log'
STUDY_NAME = 'sweep'
STATES = {TrialState.COMPLETE: 'complete', TrialState.PRUNED: 'pruned',
          TrialState.FAIL: 'failed', TrialState.RUNNING: 'interrupted',
          TrialState.WAITING: 'waiting'}
# What a rerun may change; anything else in the settings (config, overrides, search type,
# space, metric) would mix trials of different searches in one study.
FREE_FLAGS = '--num_trials, --parallel, --prune, --startup_trials and --search_seed'


def run_dir_name(number: int) -> str:
  return f'trial_{number:04d}'


def open_study(workdir: str, settings: dict, search: str, search_seed: int,
               startup_trials: int, prune: bool) -> optuna.Study:
  """The study of `workdir`: created with `settings`, or loaded and checked against them.

  `settings` are {'config', 'overrides', 'search', 'space', 'metric'}, all JSON values.
  """
  optuna.logging.set_verbosity(optuna.logging.WARNING)  # sweep.py logs every trial itself.
  storage = optuna.storages.JournalStorage(
      optuna.storages.journal.JournalFileBackend(os.path.join(workdir, STUDY_FILE)))
  study = optuna.create_study(
      storage=storage, study_name=STUDY_NAME, load_if_exists=True,
      direction='maximize' if runs.maximized(settings['metric']) else 'minimize')
  stored = study.user_attrs.get('sweep')
  if stored is None:
    study.set_user_attr('sweep', settings)
  elif stored != settings:
    differences = '; '.join(f'{name} {stored.get(name)!r} there, {value!r} now'
                            for name, value in settings.items() if stored.get(name) != value)
    raise spec.SweepError(f'The study in {workdir} was run with other settings ({differences}): '
                          f'rerun it with its own (only {FREE_FLAGS} may change), or use '
                          'another --workdir.')
  # Seeded by the trial count as well: the trials a rerun adds must not repeat the first ones.
  seed = int(np.random.SeedSequence([search_seed, len(study.trials)]).generate_state(1)[0])
  study.sampler = (optuna.samplers.RandomSampler(seed=seed) if search == 'random' else
                   optuna.samplers.TPESampler(n_startup_trials=startup_trials, seed=seed))
  study.pruner = (optuna.pruners.MedianPruner(n_startup_trials=startup_trials) if prune else
                  optuna.pruners.NopPruner())
  return study


def run_trials(study: optuna.Study, space: dict, num_trials: int, parallel: int,
               launcher: runs.Launcher, config_file: str, base_args: tuple[str, ...],
               workdir: str, metric: str) -> None:
  """Resumes the study's interrupted trials, then runs new ones until it has `num_trials`."""
  lock = threading.Lock()
  trials = study.get_trials(deepcopy=False)
  interrupted = [trial for trial in trials if trial.state == TrialState.RUNNING]
  logging.info('%s search of %d trials in %s: %d finished, %d to resume, %d to run, %d at a '
               'time%s.', study.user_attrs['sweep']['search'], max(num_trials, len(trials)),
               workdir, len(trials) - len(interrupted), len(interrupted),
               max(num_trials - len(trials), 0), parallel,
               '' if isinstance(study.pruner, optuna.pruners.NopPruner) else ', with pruning')

  def next_trial() -> tuple[optuna.Trial, set[int]] | None:
    """The next trial to run and the epochs it has reported already; None when done."""
    with lock:
      if launcher.stopped_by:
        return None
      if interrupted:
        frozen = interrupted.pop(0)
        logging.info('Trial %d: resuming in %s', frozen.number, run_dir_name(frozen.number))
        # Built as Study.ask builds it, for a trial that exists already: with its number,
        # parameters and reports.
        trial = optuna.Trial(study, frozen._trial_id)  # pylint: disable=protected-access
        return trial, set(frozen.intermediate_values)
      if len(study.get_trials(deepcopy=False)) >= num_trials:
        return None
      trial = study.ask(space)
      trial.set_user_attr('run', run_dir_name(trial.number))
      return trial, set()

  def work() -> None:
    while (next_ := next_trial()) is not None:
      _run_trial(*next_, study, launcher, config_file, base_args, workdir, metric)

  with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
    for future in [pool.submit(work) for _ in range(parallel)]:
      future.result()
  if not launcher.stopped_by and study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
    best = study.best_trial
    logging.info('Best: trial %d (%s), %s %.4f.', best.number, _describe(best.params), metric,
                 best.value)


def _run_trial(trial: optuna.Trial, reported: set[int], study: optuna.Study,
               launcher: runs.Launcher, config_file: str, base_args: tuple[str, ...],
               workdir: str, metric: str) -> None:
  """Runs (or resumes) `trial`'s main.py, reporting every epoch's metric, and tells the study."""
  name = run_dir_name(trial.number)
  run_dir = os.path.join(workdir, name)
  args = base_args + tuple(f'--config.{key}={value}' for key, value in trial.params.items())
  num_epochs = spec.resolve_config(config_file, args).num_epochs
  pruned = None  # (epoch, value) of the report that pruned the trial.

  def should_stop() -> bool:
    """Reports the epochs main.py has evaluated since the last call; True to prune."""
    nonlocal pruned
    for epoch, value in enumerate(runs.scalars(run_dir, [metric])[metric], 1):
      if epoch in reported:
        continue
      trial.report(value, epoch)
      reported.add(epoch)
      # Judged at every epoch but the last, however late the report: the outcome does not
      # depend on the moment the files were read.
      if epoch < num_epochs and trial.should_prune():
        pruned = epoch, value
        return True
    return False

  start = time.time()
  returncode = launcher.run(name, run_dir, args, should_stop)
  if returncode is None:  # The sweep stopped before the run started: a rerun resumes it.
    return
  if pruned is None:
    should_stop()  # The epochs written since the last read.
  summary = runs.summarize(run_dir, metric)
  summary['wall_time_s'] = round(trial.user_attrs.get('wall_time_s', 0) + time.time() - start, 1)
  for key, value in summary.items():
    trial.set_user_attr(key, value)
  best = summary[f'best_{metric}']
  if pruned is not None:
    study.tell(trial, state=TrialState.PRUNED)
    logging.info('Trial %d (%s): pruned after epoch %d, its %s %.4f worse than the median of '
                 'earlier trials there', trial.number, _describe(trial.params), pruned[0], metric,
                 pruned[1])
  elif returncode == 0 and best is not None:
    study.tell(trial, best)
    logging.info('Trial %d (%s): complete in %.0fs, best %s %.4f', trial.number,
                 _describe(trial.params), summary['wall_time_s'], metric, best)
  elif launcher.stopped_by:
    logging.warning('Trial %d: interrupted; rerun the same command to resume it in %s',
                    trial.number, run_dir)
  else:
    study.tell(trial, state=TrialState.FAIL)
    logging.warning('Trial %d (%s): failed (exit %d), see %s; failed trials are not rerun.',
                    trial.number, _describe(trial.params), returncode,
                    os.path.join(run_dir, 'main.log'))


def _describe(params: dict) -> str:
  return ', '.join(f'{key}={value:.4g}' if isinstance(value, float) else f'{key}={value}'
                   for key, value in params.items())


def results(study: optuna.Study, space: dict, metric: str) -> tuple[list[dict], list[str]]:
  """One row per trial (number, state, sampled values, metrics) and the table's columns."""
  rows = [{'trial': trial.number, 'state': STATES[trial.state], **trial.params,
           **trial.user_attrs} for trial in study.get_trials(deepcopy=False)]
  columns = ['trial', 'state', *space, f'best_{metric}', f'final_{metric}', 'epochs',
             'wall_time_s']
  if any('test_accuracy' in row for row in rows):
    columns.append('test_accuracy')
  return rows, columns + ['run']
