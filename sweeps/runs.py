"""A sweep's main.py runs, each in its own directory: launching, stopping, metrics, results."""

import contextlib
import csv
import fcntl
import logging as std_logging
import os
import signal
import subprocess
import sys
import threading
from typing import Callable

from absl import logging
from tensorboard.backend.event_processing import event_accumulator
import tensorflow as tf

from sweeps import spec

MAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'main.py')
POLL_SECONDS = 2  # How often a running trial's TensorBoard files are read (for pruning).
# TensorBoard's file reader logs every file it opens, at each read of a running trial.
std_logging.getLogger('tensorboard').setLevel(std_logging.WARNING)


def maximized(metric: str) -> bool:
  """Whether larger values of `metric` are better: all but losses."""
  return not metric.endswith('loss')


class Launcher:
  """Runs main.py processes; `stop` (the sweep's SIGTERM/SIGINT handler) stops them all.

  Each main.py runs in its own session, so a Ctrl-C in the terminal reaches sweep.py only, which
  sends every run one SIGTERM: main.py then saves a checkpoint and exits (a second signal would
  stop it at once, without one). Runs not started yet do not start.
  """

  def __init__(self, config_file: str, env: dict[str, str]):
    self._config_file = config_file
    self._env = env
    self._lock = threading.Lock()
    self._running = set()
    self.stopped_by = None  # The signal that stopped the sweep, if any.

  def stop(self, signum, frame=None) -> None:
    del frame
    logging.warning('Received %s: stopping the running main.py processes (each saves a '
                    'checkpoint); rerun the same command to resume.', signal.Signals(signum).name)
    with self._lock:
      self.stopped_by = signum
      for process in self._running:
        process.send_signal(signal.SIGTERM)

  def run(self, name: str, run_dir: str, args: tuple[str, ...],
          should_stop: Callable[[], bool] | None = None) -> int | None:
    """Runs main.py in `run_dir` with `args`; returns its exit code (None: the sweep stopped).

    While it runs, `should_stop()` is called every POLL_SECONDS; once it returns True the run
    gets a SIGTERM (it saves a checkpoint and exits).
    """
    os.makedirs(run_dir, exist_ok=True)
    log_file = os.path.join(run_dir, 'main.log')
    with open(log_file, 'a') as log:
      with self._lock:
        if self.stopped_by:
          return None
        logging.info('Run %s: started, log in %s', name, log_file)
        process = subprocess.Popen(
            [sys.executable, MAIN, f'--config={self._config_file}', f'--workdir={run_dir}',
             *args], stdout=log, stderr=subprocess.STDOUT, env=self._env,
            start_new_session=True)
        self._running.add(process)
      stop_sent = False
      try:
        while True:
          try:
            returncode = process.wait(timeout=POLL_SECONDS)
            break
          except subprocess.TimeoutExpired:
            if should_stop and not stop_sent and should_stop():
              process.send_signal(signal.SIGTERM)
              stop_sent = True
      finally:
        if process.poll() is None:  # Only after an error in should_stop: no orphan run.
          process.terminate()
          process.wait()
        with self._lock:
          self._running.discard(process)
    if returncode and not (stop_sent or self.stopped_by):
      with open(log_file) as log:
        tail = ''.join(log.readlines()[-15:])
      logging.error('Run %s failed (exit %d); end of %s:\n%s', name, returncode, log_file, tail)
    return returncode


@contextlib.contextmanager
def hold(workdir: str):
  """Holds the sweep's workdir until the block ends; SweepError if another sweep holds it.

  A second sweep.py there would take this one's running runs for interrupted ones and run them
  again. The `flock` ends with the process, however it ends.
  """
  with open(os.path.join(workdir, 'sweep.lock'), 'a') as lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise spec.SweepError(f'{workdir} is in use by another sweep.py: wait for it to end or '
                            'stop it, or pass another --workdir.') from None
    yield


def scalars(run_dir: str, tags: list[str]) -> dict[str, list[float]]:
  """Each tag's values in the run's TensorBoard files, by step (the last write of a step wins)."""
  accumulator = event_accumulator.EventAccumulator(run_dir, size_guidance={'tensors': 0})
  accumulator.Reload()
  written = set(accumulator.Tags()['tensors'])
  values = {}
  for tag in tags:
    events = sorted(accumulator.Tensors(tag), key=lambda e: e.wall_time) if tag in written else []
    by_step = {event.step: float(tf.make_ndarray(event.tensor_proto)) for event in events}
    values[tag] = [by_step[step] for step in sorted(by_step)]
  return values


def summarize(run_dir: str, metric: str) -> dict[str, float | int | None]:
  """best_<metric> and final_<metric> over the run's evals, their number, and test_accuracy
  when the run wrote one."""
  values = scalars(run_dir, [metric, 'test_accuracy'])
  evals = values[metric]
  summary = {f'best_{metric}': (max if maximized(metric) else min)(evals) if evals else None,
             f'final_{metric}': evals[-1] if evals else None, 'epochs': len(evals)}
  if values['test_accuracy']:
    summary['test_accuracy'] = values['test_accuracy'][-1]
  return summary


def _cell(column: str, value) -> str:
  if value is None:
    return ''
  if isinstance(value, float):
    if column.endswith(('accuracy', 'loss')):
      return f'{value:.4f}'
    return f'{value:.1f}' if column == 'wall_time_s' else f'{value:.4g}'  # Else sampled values.
  return str(value)


def write_results(rows: list[dict], columns: list[str], metric: str, workdir: str) -> str:
  """Writes `rows`, best `metric` first, as sweep_results.csv and .md; returns the markdown."""
  best = f'best_{metric}'
  sign = -1 if maximized(metric) else 1
  rows = sorted(rows, key=lambda row: (row.get(best) is None, sign * (row.get(best) or 0)))
  with open(os.path.join(workdir, 'sweep_results.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, columns, extrasaction='ignore')
    writer.writeheader()
    writer.writerows(rows)
  lines = [columns, ['---'] * len(columns)]
  lines += [[_cell(column, row.get(column)) for column in columns] for row in rows]
  table = '\n'.join('| ' + ' | '.join(line) + ' |' for line in lines) + '\n'
  with open(os.path.join(workdir, 'sweep_results.md'), 'w') as f:
    f.write(table)
  return table
