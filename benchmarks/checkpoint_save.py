"""How long `CheckpointManager.save` blocks the train loop: synchronous vs Orbax's async saves.

  python -m benchmarks.checkpoint_save [--json=checkpoint_save.json]

Saves the default CNN's training state (model + SGD momentum, 6.6 MB) 8 times, 1 s apart (the
training between saves), and reports the blocking time of the last 7 (the first compiles);
--json writes them (`harness.write_json`).
"""

import tempfile
import time

from core import runtime  # pylint: disable=g-bad-import-order  (first: it must precede tensorflow)

runtime.start()

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top
from absl import logging  # pylint: disable=g-import-not-at-top
from flax import nnx  # pylint: disable=g-import-not-at-top
import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

from benchmarks import harness  # pylint: disable=g-import-not-at-top
from configs import default  # pylint: disable=g-import-not-at-top
from data_sources import base  # pylint: disable=g-import-not-at-top
from training import run_spec  # pylint: disable=g-import-not-at-top
from training import state as state_lib  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_string('json', None, 'Where to write the figures (optional).')
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


def main(argv):
  del argv
  logging.set_verbosity(logging.ERROR)
  run = run_spec.resolve(default.get_config())
  info = base.DatasetInfo('mnist', (28, 28, 1), 10, 60_000, 10_000)
  schedule = run.optimization.learning_rate_schedule(468)  # MNIST's steps per epoch at 128.
  items = {'state': nnx.state(state_lib.create(run.model, info, run.optimization, schedule,
                                               seed=run.seed, ema_decay=run.ema_decay))}
  blocking_ms = {}
  for enable_async in (False, True):
    times = [seconds * 1000 for seconds in blocking_times(items, enable_async)]
    blocking_ms[f'enable_async_checkpointing={enable_async}'] = times
    print(f'enable_async_checkpointing={enable_async}: save() blocks for a median of '
          f'{harness.median(times):.0f} ms (min {times[0]:.0f}, max {times[-1]:.0f}) over '
          f'{len(times)} saves')
  if FLAGS.json:
    harness.write_json(FLAGS.json, {'saves_timed': _SAVES - 1, 'blocking_ms': blocking_ms})


if __name__ == '__main__':
  app.run(main)
