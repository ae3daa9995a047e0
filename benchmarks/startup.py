"""How long a run takes to start training, with JAX's compilation cache cold and then warm.

    python -m benchmarks.startup --json=startup.json [--rounds=2] -- \
        python main.py --config=configs/default.py --workdir={workdir} --config.num_epochs=1

Each round runs the command after `--` (`python` is this interpreter; `{workdir}` becomes a new
empty directory for every run) twice, sharing one new compilation cache
(`$JAX_COMPILATION_CACHE_DIR`, which main.py's --compilation_cache defaults to): first with
the cache empty (cold: every program compiled), then with what the first run left there (warm:
a rerun of the same model in a new workdir, as a sweep's next trial or a second experiment).
Figures of each run: seconds from spawn to the app's 'Training for' line, which comes after
the training state is created and the train and eval steps are compiled, just before the
first step; and from spawn to exit. --json keeps every round, with medians.
"""

import os
import shlex
import sys
import tempfile
import time

from absl import app
from absl import flags

from benchmarks import harness

FLAGS = flags.FLAGS
TRAINING_STARTS = 'Training for '  # train.py's line just before the first step.


def define_flags() -> None:
  """The command line's flags: defined when run, not at import."""
  flags.DEFINE_string('json', None, 'Where to write the figures.')
  flags.mark_flag_as_required('json')
  flags.DEFINE_integer('rounds', 2, 'Cold + warm pairs, each with a new cache.', lower_bound=1)


def timed_run(command: list[str], cache: str) -> dict[str, float]:
  """Runs `command` with `{workdir}` set to a new directory and the compilation cache in
  `cache`; its seconds to the training loop and to exit."""
  with tempfile.TemporaryDirectory() as workdir:
    argv = [sys.executable if arg == 'python' else arg.replace('{workdir}', workdir)
            for arg in command]
    start = time.perf_counter()
    seen = {}

    def note(line: str) -> bool:
      if TRAINING_STARTS in line and 'to_training_seconds' not in seen:
        seen['to_training_seconds'] = time.perf_counter() - start
      return False

    child = harness.run_child(argv, env={**os.environ, 'JAX_COMPILATION_CACHE_DIR': cache},
                              stop=note)
  if not seen:
    raise RuntimeError(f'{shlex.join(argv)} never printed {TRAINING_STARTS!r}; its output '
                       f'ends:\n{child.output_tail}')
  return {**seen, 'process_seconds': child.seconds}


def main(argv):
  command = argv[1:]
  if not command:
    raise app.UsageError('Give the command to time after --, with {workdir} in it.')
  print(harness.machine_line(harness.machine()), flush=True)
  rounds = []
  for index in range(1, FLAGS.rounds + 1):
    with tempfile.TemporaryDirectory() as cache:
      cold, warm = timed_run(command, cache), timed_run(command, cache)
    rounds.append({'cold': cold, 'warm': warm})
    print(f'round {index}: to training {cold["to_training_seconds"]:.1f} s cold, '
          f'{warm["to_training_seconds"]:.1f} s warm; whole run {cold["process_seconds"]:.1f} s '
          f'cold, {warm["process_seconds"]:.1f} s warm', flush=True)
  medians = {start: {key: harness.median(run[start][key] for run in rounds)
                     for key in ('to_training_seconds', 'process_seconds')}
             for start in ('cold', 'warm')}
  harness.write_json(FLAGS.json, {'timed_command': shlex.join(command), 'rounds': rounds,
                                  'medians': medians})
  print(f'medians: {medians}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
