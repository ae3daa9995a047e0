"""A sweep's main.py runs, each in its own directory: launching, stopping, metrics, results."""

import csv
import os
import signal
import subprocess
import sys
import threading
from typing import Callable

from absl import logging

from training import summaries

MAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'main.py')
POLL_SECONDS = 2  # How often a running trial's metrics.jsonl is read (for pruning).
TEST_METRIC = 'test/accuracy'  # Written once, by the best checkpoint, when a run has a test split.


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

  def run(self, run_dir: str, args: tuple[str, ...],
          should_stop: Callable[[], bool] | None = None) -> int | None:
    """Runs main.py in `run_dir` with `args`; returns its exit code (None: the sweep stopped).

    While it runs, `should_stop()` is called every POLL_SECONDS; once it returns True the run
    gets a SIGTERM (it saves a checkpoint and exits).
    """
    name = os.path.basename(run_dir)
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


def evals(run_dir: str, metric: str) -> list[float]:
  """The run's values of `metric` in step order: one per eval, so the k-th is epoch k's."""
  metrics = summaries.read_metrics(run_dir)
  return [metrics[step][metric] for step in sorted(metrics) if metric in metrics[step]]


def summarize(run_dir: str, metric: str, maximize: bool) -> dict[str, float | int | None]:
  """best_<metric> and final_<metric> over the run's evals, their number, and test/accuracy
  when the run wrote one."""
  values = evals(run_dir, metric)
  summary = {f'best_{metric}': (max if maximize else min)(values) if values else None,
             f'final_{metric}': values[-1] if values else None, 'epochs': len(values)}
  if tests := evals(run_dir, TEST_METRIC):
    summary[TEST_METRIC] = tests[-1]
  return summary


def _cell(column: str, value) -> str:
  if value is None:
    return ''
  if isinstance(value, float):
    if '/' in column:  # A metric (swept keys have dots, not slashes).
      return f'{value:.4f}'
    return f'{value:.1f}' if column == 'wall_time_s' else f'{value:.4g}'  # Else sampled values.
  return str(value)


def write_results(rows: list[dict], columns: list[str], metric: str, maximize: bool,
                  workdir: str) -> str:
  """Writes `rows`, best `metric` first, as sweep_results.csv and .md; returns the markdown."""
  best = f'best_{metric}'
  sign = -1 if maximize else 1
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
