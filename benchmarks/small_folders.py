"""The small-folder recipe (configs/images.py) on generated folders of several kinds and seeds.

    python -m benchmarks.small_folders --work=/tmp/small_folders [--kinds=shapes,textures,digits]
        [--seeds=0,1,2] [--out=docs/small_folders_runs] [--override=--config.model=cnn ...]

For each kind and seed, writes a folder of 1,000 images of 40-80 px with messy files
(`sample_folders.make_kind_folder`) to `<work>/<kind><seed>/`, trains `main.py
--config=configs/images.py` on it with `--config.seed=<seed>` and the overrides, and reads its
metrics.jsonl: held-out and training accuracy at the last epoch, the epochs, the wall time and
the load before and after (a shared machine's wall times compare only at equal load). Appends
one row per run to `<out>.json` (`harness.write_json`) and rewrites `<out>.md`, a table of every
row, so that runs of several recipes, failures included, stay side by side.
"""

import json
import os
import shlex
import sys

from absl import app
from absl import flags

from benchmarks import harness
import sample_folders

FLAGS = flags.FLAGS
flags.DEFINE_string('work', None, 'Where the folders and the runs go.')
flags.DEFINE_list('kinds', list(sample_folders.KINDS), 'Kinds of folders to generate.')
flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds: of the generator and of the run.')
flags.DEFINE_string('config', 'configs/images.py', 'The recipe.')
flags.DEFINE_multi_string('override', [], 'Extra main.py flags, e.g. --config.model=cnn.')
flags.DEFINE_string('label', 'recipe', 'Names this recipe in the table and the workdirs.')
flags.DEFINE_string('out', 'docs/small_folders_runs', 'Results: <out>.json and <out>.md.')
flags.mark_flag_as_required('work')


def _run(kind: str, seed: int) -> dict:
  """Generates the folder of `kind` and `seed` (unless there) and trains the recipe on it: the
  run's row."""
  root = os.path.abspath(os.path.join(FLAGS.work, f'{kind}{seed}'))
  if not os.path.isdir(root):
    sample_folders.make_kind_folder(root, kind, seed=seed)
  workdir = os.path.abspath(os.path.join(FLAGS.work, 'runs', f'{FLAGS.label}_{kind}{seed}'))
  command = ['python', 'main.py', f'--config={FLAGS.config}', f'--workdir={workdir}',
             f'--config.dataset={root}', f'--config.seed={seed}', *FLAGS.override]
  load_before = os.getloadavg()[0]
  child = harness.run_child([sys.executable, *command[1:]], check=False)
  row = {'recipe': FLAGS.label, 'kind': kind, 'seed': seed, 'wall_s': round(child.seconds, 1),
         'command': shlex.join(command), 'returncode': child.returncode,
         **harness.git_commit(), 'date': harness.utc_now(), 'load_before': load_before,
         'load_after': os.getloadavg()[0]}
  if child.returncode:
    print(child.output_tail, file=sys.stderr)
    return row
  final = harness.final_metrics(harness.read_metrics(workdir))
  return {**row, 'held_out_accuracy': final.get('eval/accuracy'),
          'train_accuracy': final.get('train/accuracy_epoch', final.get('train/accuracy')),
          'epochs': final.get('epoch')}


def _load(row: dict) -> str:
  """The load average before -> after the run, where the row has it (older rows do not)."""
  if 'load_before' not in row:
    return '-'
  return f"{row['load_before']:.1f} -> {row['load_after']:.1f}"


def _markdown(rows: list[dict]) -> str:
  """The table of every row."""
  percent = lambda value: '-' if value is None else f'{100 * value:.1f}%'
  return harness.markdown_table(
      ['recipe', 'kind', 'seed', 'held out', 'training', 'epochs', 'wall time', 'load',
       'command'],
      [[row['recipe'], row['kind'], row['seed'], percent(row.get('held_out_accuracy')),
        percent(row.get('train_accuracy')), row.get('epochs', '-'), f"{row['wall_s']:.0f} s",
        _load(row), f"`{row['command']}`"] for row in rows]) + '\n'


def main(argv):
  del argv
  path = FLAGS.out + '.json'
  rows = []
  if os.path.exists(path):
    with open(path, encoding='utf-8') as file:
      written = json.load(file)
    if not isinstance(written, dict) or 'rows' not in written:
      raise app.UsageError(f'{path} holds no rows of this benchmark (written by an older '
                           'version?): pass another --out.')
    rows = written['rows']
  for kind in FLAGS.kinds:
    for seed in map(int, FLAGS.seeds):
      row = _run(kind, seed)
      print(json.dumps(row), flush=True)
      rows.append(row)
      harness.write_json(path, {'rows': rows})  # After every run: a run can be long.
      with open(FLAGS.out + '.md', 'w', encoding='utf-8') as file:
        file.write(_markdown(rows))


if __name__ == '__main__':
  app.run(main)
