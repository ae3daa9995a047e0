"""How long `CheckpointManager.save` blocks the train loop: synchronous vs Orbax's async saves.

  python -m benchmarks.checkpoint_save

Saves the default CNN's training state (model + SGD momentum, 6.6 MB) 8 times, 1 s apart (the
training between saves), and reports the blocking time of the last 7 (the first compiles).
"""

import tempfile
import time

from core import runtime  # pylint: disable=g-bad-import-order  (first: it must precede tensorflow)

runtime.start()

from absl import logging  # pylint: disable=g-import-not-at-top
from flax import nnx  # pylint: disable=g-import-not-at-top
import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

from configs import default  # pylint: disable=g-import-not-at-top
from data_sources import base  # pylint: disable=g-import-not-at-top
from training import run_spec  # pylint: disable=g-import-not-at-top
from training import state as state_lib  # pylint: disable=g-import-not-at-top

_SAVES = 8


def blocking_times(items: dict, enable_async: bool) -> list[float]:
  with tempfile.TemporaryDirectory() as directory:
    manager = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=3, enable_async_checkpointing=enable_async),
        item_handlers={name: ocp.StandardCheckpointHandler() for name in items})
    times = []
    for step in range(1, _SAVES + 1):
      start = time.perf_counter()
      manager.save(step, args=ocp.args.Composite(
          **{name: ocp.args.StandardSave(item) for name, item in items.items()}))
      times.append(time.perf_counter() - start)
      time.sleep(1.0)
    manager.close()
  return sorted(times[1:])


def main():
  logging.set_verbosity(logging.ERROR)
  run = run_spec.resolve(default.get_config())
  info = base.DatasetInfo('mnist', (28, 28, 1), 10, 60_000, 10_000)
  schedule = run.optimization.learning_rate_schedule(468)  # MNIST's steps per epoch at 128.
  items = {'state': nnx.state(state_lib.create(run.model, info, run.optimization, schedule,
                                               seed=run.seed, ema_decay=run.ema_decay))}
  for enable_async in (False, True):
    times = blocking_times(items, enable_async)
    print(f'enable_async_checkpointing={enable_async}: save() blocks for a median of '
          f'{times[len(times) // 2] * 1000:.0f} ms (min {times[0] * 1000:.0f}, max '
          f'{times[-1] * 1000:.0f}) over {len(times)} saves')


if __name__ == '__main__':
  main()
