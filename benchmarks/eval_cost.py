"""What the evaluators cost: eval time of the whole MNIST test split with accuracy alone, the
default evaluators, and all of them, side by side.

    python -m benchmarks.eval_cost --config=configs/default.py --rounds=5

The default CNN (as initialised: the cost does not depend on the weights) is evaluated in one
process, the evaluator sets alternating round by round; the table shows each set's median
seconds per eval pass and its cost over accuracy alone; --json writes them
(`harness.write_json`).
"""

from core import runtime  # pylint: disable=g-bad-import-order  (first: it must precede tensorflow)

runtime.start()

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

from benchmarks import harness  # pylint: disable=g-import-not-at-top
import input_pipeline  # pylint: disable=g-import-not-at-top
from training import evaluation  # pylint: disable=g-import-not-at-top
import evaluators  # pylint: disable=g-import-not-at-top
from training import parallel  # pylint: disable=g-import-not-at-top
from training import run_spec  # pylint: disable=g-import-not-at-top
from training import state as state_lib  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config to evaluate with.')
flags.DEFINE_integer('rounds', 5, 'Alternating rounds; figures are medians.')
flags.DEFINE_string('json', None, 'Where to write the figures (optional).')
SETS = {'accuracy': 'accuracy',
        'loss|accuracy': 'loss|accuracy',
        'default': None,  # config.evaluators
        'all': 'loss|accuracy|top_k(5)|per_class|balanced_accuracy|confusion_matrix|'
               'misclassified(36)'}


def main(argv):
  del argv
  config = FLAGS.config
  run = run_spec.resolve(config)
  mesh = parallel.create_mesh()
  jax.set_mesh(mesh)
  data = input_pipeline.open_data(run.input, run.eval_splits())
  schedule = run.optimization.learning_rate_schedule(steps_per_epoch=1)
  state = state_lib.create(run.model, data.info, run.optimization, schedule, seed=run.seed,
                           ema_decay=run.ema_decay)
  default = run.evaluation('eval')
  num_examples = data.eval_sizes[default.name]
  batches = input_pipeline.open_eval_batches(
      data, run.input, default.split, num_examples,
      parallel.round_up(run.eval_batch_size, mesh), default.preprocess,
      place=lambda batch: parallel.shard(batch, mesh))
  runs = {name: (evaluation.Evaluation('eval', default.split, evaluators.create(spec),
                                       default.preprocess) if spec else default)
          for name, spec in SETS.items()}
  for evaluating in runs.values():
    evaluating.run(state.eval_model(), batches, data.info)  # Compiled once, outside the timing.
  seconds = {name: [] for name in runs}
  for _ in range(FLAGS.rounds):
    for name, evaluating in runs.items():
      seconds[name] += harness.time_calls(
          lambda evaluating=evaluating: evaluating.run(state.eval_model(), batches, data.info), 1)
  medians = {name: harness.median(times) for name, times in seconds.items()}
  print(f'{num_examples} examples, median of {FLAGS.rounds} rounds:')
  print(harness.markdown_table(
      ['evaluators', 's per pass', 'vs accuracy'],
      [[name, f'{median:.3f}', f'{median / medians["accuracy"] - 1:+.1%}']
       for name, median in medians.items()], align='lrr'))
  if FLAGS.json:
    harness.write_json(FLAGS.json, {'examples': num_examples, 'rounds': FLAGS.rounds,
                                    'evaluators': SETS, 'seconds_per_pass': medians,
                                    'every_round': seconds})


if __name__ == '__main__':
  app.run(main)
