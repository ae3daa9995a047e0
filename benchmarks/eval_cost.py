"""What the evaluators cost: eval time of the whole MNIST test split with accuracy alone, the
default evaluators, and all of them, side by side.

    python -m benchmarks.eval_cost --config=configs/default.py --rounds=5

The default CNN (as initialised: the cost does not depend on the weights) is evaluated in one
process, the evaluator sets alternating round by round; the table shows each set's median
seconds per eval pass and its cost over accuracy alone.
"""

import time

from core import runtime  # pylint: disable=g-bad-import-order  (first: it must precede tensorflow)

runtime.start()

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

import input_pipeline  # pylint: disable=g-import-not-at-top
from training import evaluation  # pylint: disable=g-import-not-at-top
from training import evaluators  # pylint: disable=g-import-not-at-top
from training import parallel  # pylint: disable=g-import-not-at-top
from training import state as state_lib  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config to evaluate with.')
flags.DEFINE_integer('rounds', 5, 'Alternating rounds; figures are medians.')
SETS = {'accuracy': 'accuracy',
        'loss|accuracy': 'loss|accuracy',
        'default': None,  # config.evaluators
        'all': 'loss|accuracy|top_k(5)|per_class|balanced_accuracy|confusion_matrix|'
               'misclassified(36)'}


def main(argv):
  del argv
  config = FLAGS.config
  mesh = parallel.create_mesh()
  jax.set_mesh(mesh)
  data = input_pipeline.open_data(config)
  state = state_lib.create(config, data.info, steps_per_epoch=1)
  batches = parallel.eval_batches(data, config.eval_split, data.info.num_eval_examples, config,
                                  mesh)
  runs = {name: evaluation.Evaluation('eval', evaluators.create(spec or config.evaluators),
                                      data.info, data.info.num_eval_examples)
          for name, spec in SETS.items()}
  for run in runs.values():
    run.run(state.eval_model(), batches)  # Compiled once, outside the timing.
  seconds = {name: [] for name in runs}
  for _ in range(FLAGS.rounds):
    for name, run in runs.items():
      start = time.perf_counter()
      run.run(state.eval_model(), batches)
      seconds[name].append(time.perf_counter() - start)
  base = np.median(seconds['accuracy'])
  print(f'{"evaluators":16s} {"s per pass":>11s} {"vs accuracy":>12s}   '
        f'({data.info.num_eval_examples} examples, median of {FLAGS.rounds})')
  for name, times in seconds.items():
    print(f'{name:16s} {np.median(times):11.3f} {np.median(times) / base - 1:+11.1%}')


if __name__ == '__main__':
  app.run(main)
