"""A stand-in for main.py in sweeps: studies run with a fake launcher whose accuracy is a known
function of the learning rate and the epoch (tests/test_sweep.py, tests/test_sweep_search.py)."""

import json
import os
import signal
import time

import optuna

from sweeps import engine
from sweeps import runs
from training import summaries

Categorical = optuna.distributions.CategoricalDistribution
METRIC = 'eval/accuracy'
NUM_EPOCHS = 3
BASE_ARGS = (f'--config.num_epochs={NUM_EPOCHS}',)


def accuracy(args: tuple[str, ...], epoch: int) -> float:
  """The stand-in's eval accuracy: larger learning rates and later epochs do better."""
  learning_rate = float(dict(arg[len('--config.'):].split('=', 1) for arg in args)
                        ['learning_rate'])
  return 1 - 1 / (1 + 10 * learning_rate * epoch)


class FakeLauncher:
  """Stands in for runs.Launcher: a run appends each epoch's eval line to metrics.jsonl as
  main.py does (continuing after the epochs its dir holds), then a test/accuracy line, polling
  `should_stop` after each epoch."""

  def __init__(self, stop_sweep_in=None, seconds_per_epoch=0.0):
    self.stopped_by = None
    self.started = []  # (run dir name, args) of every run started.
    self.epochs_run = {}  # Run dir name -> epochs written by its last run.
    self._stop_sweep_in = stop_sweep_in  # The run in which the sweep gets a SIGTERM.
    self._seconds_per_epoch = seconds_per_epoch

  def run(self, run_dir, args, should_stop=None):
    name = os.path.basename(run_dir)
    self.started.append((name, args))
    os.makedirs(run_dir, exist_ok=True)
    done = len(runs.evals(run_dir, METRIC))
    for epoch in range(done + 1, NUM_EPOCHS + 1):
      time.sleep(self._seconds_per_epoch)
      self._write(run_dir, {'step': epoch * 10, METRIC: accuracy(args, epoch)})
      self.epochs_run[name] = epoch - done
      if name == self._stop_sweep_in:
        self._stop_sweep_in, self.stopped_by = None, signal.SIGTERM
        return 128 + signal.SIGTERM
      if should_stop and should_stop():
        return 128 + signal.SIGTERM
    self._write(run_dir, {'step': NUM_EPOCHS * 10, runs.TEST_METRIC: 0.5})
    return 0

  @staticmethod
  def _write(run_dir, line):
    with open(os.path.join(run_dir, summaries.METRICS_FILE), 'a') as f:
      f.write(json.dumps(line) + '\n')


def settings(space_text: dict, search: str) -> dict:
  return {'config': 'configs/default.py', 'overrides': ' '.join(BASE_ARGS), 'search': search,
          'metric': METRIC, 'space': space_text}


GRID = {'learning_rate': Categorical([0.05, 0.1]), 'batch_size': Categorical([64, 128])}
GRID_SETTINGS = settings({'learning_rate': '0.05,0.1', 'batch_size': '64,128'}, 'grid')


def run_study(workdir, launcher, space=GRID, sweep_settings=GRID_SETTINGS, num_trials=None,
              prune=False, parallel=1):
  """Runs sweep.py's study in `workdir` with `launcher`, as sweep.py does; returns the study."""
  os.makedirs(workdir, exist_ok=True)
  study = engine.open_study(str(workdir), sweep_settings, space, maximize=True, search_seed=0,
                            startup_trials=2, prune=prune)
  engine.run_trials(study, space, num_trials, parallel, launcher, 'configs/default.py',
                    BASE_ARGS, str(workdir))
  return study


def load_study(workdir):
  """The study of a sweep's `workdir` (a pathlib.Path), as optuna-dashboard would open it."""
  return optuna.load_study(study_name=engine.STUDY_NAME, storage=optuna.storages.JournalStorage(
      optuna.storages.journal.JournalFileBackend(str(workdir / engine.STUDY_FILE))))
