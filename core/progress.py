"""Progress counted when the work finishes, not when it is dispatched.

JAX dispatches compiled steps asynchronously: the Python loop runs ahead of the device, by many
steps when steps are slow (at 224 px, all 20 steps of an epoch were dispatched 4 s into a 5.5
minute epoch). A count of dispatched steps says 100% long before the work is done, then nothing
while the host waits. `Finished` counts the work whose result is ready (`jax.Array.is_ready`,
which never blocks), and `Ticker` looks at it from a background thread, so lines keep coming
while the main thread waits on the device, and the loop gains no synchronisation.
"""

import collections
import threading
import time

import jax


class Finished:
  """How much dispatched work has finished: after dispatching the work up to `count`, call
  `dispatched(count, result)` with an array that work computes last; `count()` is the newest
  such count whose array is ready. Work finishes in the order it was dispatched (one stream)."""

  def __init__(self, start: int = 0):
    self._pending = collections.deque()
    self._done = start
    self._lock = threading.Lock()  # `dispatched` and `count` run on different threads.

  def dispatched(self, count: int, result: jax.Array) -> None:
    with self._lock:
      self._pending.append((count, result))

  def count(self) -> int:
    with self._lock:
      while self._pending and self._pending[0][1].is_ready():
        self._done = self._pending.popleft()[0]
      return self._done


class Ticker:
  """Calls `tick()` every `seconds` on a daemon thread, from `start()` until `stop()`."""

  def __init__(self, tick, seconds: float):
    self._tick, self._seconds = tick, seconds
    self._stopped = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True, name='progress')

  def start(self) -> 'Ticker':
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stopped.set()
    self._thread.join()

  def _run(self) -> None:
    while not self._stopped.wait(self._seconds):
      self._tick()

  def __enter__(self) -> 'Ticker':
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()


class Rate:
  """Units per second and the time left, from the units finished since the first one was seen
  (the first step's compilation and start-up excluded)."""

  def __init__(self, start: int, total: int):
    self._start, self._total = start, total
    self._first = None  # (time, count) when work was first seen finished.

  def update(self, done: int) -> tuple[float, float] | None:
    """(units per second, seconds left) at `done` units finished; None until measurable."""
    now = time.time()
    if self._first is None and done > self._start:
      self._first = now, done
    if self._first is None or done <= self._first[1]:
      return None
    rate = (done - self._first[1]) / max(now - self._first[0], 1e-9)
    return rate, (self._total - done) / rate


def duration(seconds: float) -> str:
  """'1h02m', '3m05s' or '42s'."""
  seconds = int(round(seconds))
  if seconds >= 3600:
    return f'{seconds // 3600}h{seconds % 3600 // 60:02d}m'
  return f'{seconds // 60}m{seconds % 60:02d}s' if seconds >= 60 else f'{seconds}s'
