"""The sweep's Optuna study, run with ask and tell: one main.py run per trial.

The study lives in <workdir>/optuna_journal.log (Optuna's journal file storage); trial N runs in
<workdir>/trial_NNNN. A grid, a random and a TPE search differ only in the sampler. With
pruning, each epoch's metric is read from the run's metrics.jsonl while main.py runs and
reported to Optuna's median pruner; a trial it judges unpromising after any epoch but the last
is recorded as pruned, and its run, if still going, gets a SIGTERM (it saves a checkpoint and
exits).

A trial left running by a stopped or killed sweep is resumed by the next sweep: the study gets a
new trial with the same parameters and run directory (`enqueue_trial`), where main.py continues
from the checkpoint it left, and its user attribute `resumes` names the interrupted trial, which
is then finished as failed. Such superseded trials count nowhere: not in the trials a search
asks for, nor in the results.
"""

import concurrent.futures
import glob
import math
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
          TrialState.WAITING: 'interrupted'}
# What a rerun may change; anything else in the settings (config, overrides, search type,
# space, metric) would mix trials of different sweeps in one study.
FREE_FLAGS = '--num_trials, --parallel, --prune, --startup_trials and --search_seed'
OLD_GRID_FILE = 'sweep_run.json'  # In each finished run of a grid by sweep.py before the study.


class GridSampler(optuna.samplers.GridSampler):
  """Optuna's GridSampler without its `study.stop()` after the last point, which works only
  inside `Study.optimize`: the ask-and-tell loop here stops by itself."""

  def after_trial(self, study, trial, state, values) -> None:
    del study, trial, state, values


def open_study(workdir: str, settings: dict, space: dict, maximize: bool, search_seed: int,
               startup_trials: int, prune: bool) -> optuna.Study:
  """The study of `workdir`: created with `settings`, or loaded and checked against them.

  `settings` are {'config', 'overrides', 'search', 'space', 'metric'}, all JSON values; the
  sampler is the search's ('grid', 'random' or 'tpe') over `space`.
  """
  if old := glob.glob(os.path.join(glob.escape(workdir), '*', OLD_GRID_FILE)):
    raise spec.SweepError(f'{workdir} holds a grid of an older sweep.py ({old[0]}), which this '
                          'one cannot continue: use another --workdir.', workdir)
  optuna.logging.set_verbosity(optuna.logging.WARNING)  # sweep.py logs every trial itself.
  storage = optuna.storages.JournalStorage(
      optuna.storages.journal.JournalFileBackend(os.path.join(workdir, STUDY_FILE)))
  study = optuna.create_study(storage=storage, study_name=STUDY_NAME, load_if_exists=True,
                              direction='maximize' if maximize else 'minimize')
  stored = study.user_attrs.get('sweep')
  if stored is None:
    study.set_user_attr('sweep', settings)
  elif stored != settings:
    differences = '; '.join(f'{name} {stored.get(name)!r} there, {value!r} now'
                            for name, value in settings.items() if stored.get(name) != value)
    raise spec.SweepError(f'The study in {workdir} was run with other settings ({differences}): '
                          f'rerun it with its own (only {FREE_FLAGS} may change), or use '
                          'another --workdir.', workdir)
  # Seeded by the trial count as well: the trials a rerun adds must not repeat the first ones.
  seed = int(np.random.SeedSequence([search_seed, len(study.trials)]).generate_state(1)[0])
  if settings['search'] == 'grid':  # Its own fixed order: each rerun must number points alike.
    study.sampler = GridSampler({key: dist.choices for key, dist in space.items()})
  elif settings['search'] == 'random':
    study.sampler = optuna.samplers.RandomSampler(seed=seed)
  else:
    study.sampler = optuna.samplers.TPESampler(n_startup_trials=startup_trials, seed=seed)
  study.pruner = (optuna.pruners.MedianPruner(n_startup_trials=startup_trials) if prune else
                  optuna.pruners.NopPruner())
  return study


def maximizes(study: optuna.Study) -> bool:
  return study.direction == optuna.study.StudyDirection.MAXIMIZE


def trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
  """The study's trials, less those superseded by their resumption."""
  every = study.get_trials(deepcopy=False)
  superseded = {trial.user_attrs['resumes'] for trial in every if 'resumes' in trial.user_attrs}
  return [trial for trial in every if trial.number not in superseded]


def run_trials(study: optuna.Study, space: dict, num_trials: int | None, parallel: int,
               launcher: runs.Launcher, config_file: str, base_args: tuple[str, ...],
               workdir: str) -> None:
  """Resumes the study's interrupted trials, then runs new ones until it has `num_trials`.

  A grid (`num_trials` None) runs until it has a trial per point. Counting trials rather than
  asking the GridSampler whether it is exhausted keeps the last points from running twice with
  --parallel: while they run it is not exhausted, and it would hand them out again.
  """
  if num_trials is None:
    num_trials = math.prod(len(distribution.choices) for distribution in space.values())
  lock = threading.Lock()
  current = trials(study)
  interrupted = [trial for trial in current if trial.state == TrialState.RUNNING]
  waiting = sum(trial.state == TrialState.WAITING for trial in current)  # Left by a SIGKILL.
  logging.info('%s sweep of %d trials in %s: %d finished, %d to resume, %d to run, %d at a '
               'time%s.', study.user_attrs['sweep']['search'], max(num_trials, len(current)),
               workdir, len(current) - len(interrupted) - waiting, len(interrupted) + waiting,
               max(num_trials - len(current), 0), parallel,
               '' if isinstance(study.pruner, optuna.pruners.NopPruner) else ', with pruning')

  def next_trial() -> optuna.Trial | None:
    """The next trial to run (asked, or resumed); None when done."""
    with lock:
      if launcher.stopped_by:
        return None
      if interrupted:
        # Enqueued before the old trial is finished: a sweep killed in between leaves it
        # superseded, never lost.
        old = interrupted.pop(0)
        study.enqueue_trial(old.params, user_attrs={**old.user_attrs, 'resumes': old.number})
        study.tell(old.number, state=TrialState.FAIL)
      elif (not study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
            and len(trials(study)) >= num_trials):
        return None
      trial = study.ask(space)
      if 'run' in trial.user_attrs:
        logging.info('Trial %d: resuming trial %d in %s', trial.number,
                     trial.user_attrs['resumes'], trial.user_attrs['run'])
      else:
        trial.set_user_attr('run', f'trial_{trial.number:04d}')
      return trial

  def work() -> None:
    while (trial := next_trial()) is not None:
      _run_trial(trial, study, launcher, config_file, base_args, workdir)

  with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
    for future in [pool.submit(work) for _ in range(parallel)]:
      future.result()
  if not launcher.stopped_by and study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
    best = study.best_trial
    logging.info('Best: trial %d (%s), %s %.4f.', best.number, _describe(best.params),
                 study.user_attrs['sweep']['metric'], best.value)


def _run_trial(trial: optuna.Trial, study: optuna.Study, launcher: runs.Launcher,
               config_file: str, base_args: tuple[str, ...], workdir: str) -> None:
  """Runs (or resumes) `trial`'s main.py, reporting every epoch's metric, and tells the study."""
  run_dir = os.path.join(workdir, trial.user_attrs['run'])
  metric = study.user_attrs['sweep']['metric']
  args = base_args + spec.args(trial.params)
  num_epochs = spec.resolve_config(config_file, args).num_epochs
  reported = 0  # Epochs reported so far (a resumed trial reports its earlier ones again).
  pruned = None  # (epoch, value) of the report that pruned the trial.

  def should_stop() -> bool:
    """Reports the epochs main.py has evaluated since the last call; True to prune."""
    nonlocal reported, pruned
    for epoch, value in enumerate(runs.evals(run_dir, metric)[reported:], reported + 1):
      trial.report(value, epoch)
      reported = epoch
      # Judged at every epoch but the last, however late the report: the outcome does not
      # depend on the moment the file was read.
      if epoch < num_epochs and trial.should_prune():
        pruned = epoch, value
        return True
    return False

  start = time.time()
  returncode = launcher.run(run_dir, args, should_stop)
  if returncode is None:  # The sweep stopped before the run started: a rerun resumes it.
    return
  if pruned is None:
    should_stop()  # The epochs written since the last read.
  summary = runs.summarize(run_dir, metric, maximizes(study))
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


def results(study: optuna.Study, space: dict) -> tuple[list[dict], list[str]]:
  """One row per trial (number, state, values, metrics, run directory) and the table's columns."""
  metric = study.user_attrs['sweep']['metric']
  rows = [{'trial': trial.number, 'state': STATES[trial.state], **trial.params,
           **trial.user_attrs} for trial in trials(study)]
  columns = ['trial', 'state', *space, f'best_{metric}', f'final_{metric}', 'epochs',
             'wall_time_s']
  if any(runs.TEST_METRIC in row for row in rows):
    columns.append(runs.TEST_METRIC)
  return rows, columns + ['run']
