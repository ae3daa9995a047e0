"""Records a run of the app for a figure in the docs: runs the command, then writes its artefact.

    python -m benchmarks.record --json=docs/runs/default.json -- \
        python main.py --config=configs/default.py --workdir=/tmp/default

Runs the command after `--` as a child from the repository root (its output shown as it comes;
`python` is this interpreter), then writes --json (`harness.write_json`): this recorder's own
command (rerun it to regenerate the file), the commit, the machine and the date; the run's
command, wall time (spawn to exit), peak RSS and exit code; and from the workdir the command
names (its --workdir), each metric's last value in metrics.jsonl (`final_metrics`, with the last
step), every evaluation's figures by step (`evaluations`) and every epoch's training figures
(`training`: loss, accuracy, examples a second). A run that fails writes nothing
and ends this one with its exit status.
"""

import shlex
import sys

from absl import app
from absl import flags

from benchmarks import harness

FLAGS = flags.FLAGS
_EVALUATION_PREFIXES = ('eval/', 'test/')  # Metrics of a split evaluated, not of training.


def define_flags() -> None:
  """The command line's flags: defined when run, not at import (tests import the module
  beside other benchmarks, whose flags share names)."""
  flags.DEFINE_string('json', None, 'Where to write the artefact.')
  flags.mark_flag_as_required('json')


def workdir_of(command: list[str]) -> str:
  """The value of the command's --workdir flag (`--workdir=X` or `--workdir X`)."""
  for index, arg in enumerate(command):
    if arg.startswith('--workdir='):
      return arg.split('=', 1)[1]
    if arg == '--workdir' and index + 1 < len(command):
      return command[index + 1]
  raise app.UsageError(f'{shlex.join(command)} names no --workdir: the recorder reads the '
                       "run's metrics there.")


def logged(steps: list[dict[str, float]],
           prefixes: tuple[str, ...]) -> list[dict[str, float]]:
  """The steps of `steps` (harness.read_metrics's) that logged metrics named with one of
  `prefixes`: their step, epoch and those metrics."""
  return [{'step': values['step'], **({'epoch': values['epoch']} if 'epoch' in values else {}),
           **{name: value for name, value in values.items() if name.startswith(prefixes)}}
          for values in steps if any(name.startswith(prefixes) for name in values)]


def record(command: list[str], json_path: str) -> None:
  """Runs `command` and writes its artefact to `json_path`; exits with its status if it fails."""
  workdir = workdir_of(command)
  child = harness.run_child([sys.executable if command[0] == 'python' else command[0],
                             *command[1:]], echo=True, check=False)
  if child.returncode:
    sys.exit(f'{shlex.join(command)} failed with status {child.returncode}: {json_path} not '
             'written.')
  steps = harness.read_metrics(workdir)
  harness.write_json(json_path, {
      'run': {'command': shlex.join(command), 'wall_s': child.seconds,
              'peak_rss_mb': child.peak_rss_mb, 'returncode': child.returncode,
              'workdir': workdir},
      'final_metrics': harness.final_metrics(steps),
      'evaluations': logged(steps, _EVALUATION_PREFIXES), 'training': logged(steps, ('train/',))})
  print(f'Wrote {json_path}.')


def main(argv):
  if len(argv) < 2:
    raise app.UsageError('Give the command to record after --, e.g. -- python main.py '
                         '--config=configs/default.py --workdir=/tmp/default')
  record(argv[1:], FLAGS.json)


if __name__ == '__main__':
  define_flags()
  app.run(main)
