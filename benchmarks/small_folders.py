"""The small-folder recipe (configs/images.py) on generated folders of several kinds and seeds.

    python -m benchmarks.small_folders --work=/tmp/small_folders [--kinds=shapes,textures,digits]
        [--seeds=0,1,2] [--out=docs/small_folders_runs] [--override=--config.model=cnn ...]

For each kind and seed, writes a folder of 1,000 images of 40-80 px with messy files
(`data_sources.generated.make_kind_folder`) to `<work>/<kind><seed>/`, trains
`main.py --config=configs/images.py` on it in `<work>/runs/<label>_<kind><seed>/` with
`--config.seed=<seed>` and the overrides, and reads its metrics.jsonl: the held-out accuracy
(`eval/accuracy`, the last 10% of `train`) and the training accuracy (`train/accuracy_epoch`,
the mean over the last epoch's augmented batches) at the last epoch, the epochs, and the run's
wall time (start-up included), with the CPU's model and the machine's load average (1 minute)
before and after the run: the machine is shared, so wall times are only comparable at equal
load. Appends one row per run to `<out>.json` and rewrites `<out>.md` (a table of every
row), so that runs of several recipes, failures included, stay side by side.
"""

import json
import os
import platform
import shlex
import subprocess
import sys
import time

from absl import app
from absl import flags

from data_sources import generated

FLAGS = flags.FLAGS
flags.DEFINE_string('work', None, 'Where the folders and the runs go.')
flags.DEFINE_list('kinds', list(generated.KINDS), 'Kinds of folders to generate.')
flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds: of the generator and of the run.')
flags.DEFINE_string('config', 'configs/images.py', 'The recipe.')
flags.DEFINE_multi_string('override', [], 'Extra main.py flags, e.g. --config.model=cnn.')
flags.DEFINE_string('label', 'recipe', 'Names this recipe in the table and the workdirs.')
flags.DEFINE_string('out', 'docs/small_folders_runs', 'Results: <out>.json and <out>.md.')
flags.mark_flag_as_required('work')


def _last_epoch(workdir: str) -> dict:
  """The last epoch's training and held-out figures from the run's metrics.jsonl."""
  train, held_out = {}, {}
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as file:
    for line in file:
      record = json.loads(line)
      if 'epoch' in record:
        train = record
      if 'eval/accuracy' in record:
        held_out = record
  return {'held_out_accuracy': held_out.get('eval/accuracy'),
          'train_accuracy': train.get('train/accuracy_epoch', train.get('train/accuracy')),
          'epochs': train.get('epoch')}


def _cpu_model() -> str:
  """The CPU's model name as lscpu gives it (/proc/cpuinfo's), else the platform's."""
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as file:
      for line in file:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor()


def _run(kind: str, seed: int) -> dict:
  root = os.path.join(FLAGS.work, f'{kind}{seed}')
  if not os.path.isdir(root):
    generated.make_kind_folder(root, kind, seed=seed)
  workdir = os.path.join(FLAGS.work, 'runs', f'{FLAGS.label}_{kind}{seed}')
  command = ['python', 'main.py', f'--config={FLAGS.config}', f'--workdir={workdir}',
             f'--config.dataset={root}', f'--config.seed={seed}', *FLAGS.override]
  load_before = os.getloadavg()[0]
  start = time.time()
  process = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True,
                           check=False)
  row = {'recipe': FLAGS.label, 'kind': kind, 'seed': seed,
         'wall_s': round(time.time() - start, 1), 'command': shlex.join(command),
         'returncode': process.returncode, 'cpu': _cpu_model(), 'cpus': os.cpu_count(),
         'load_before': load_before, 'load_after': os.getloadavg()[0]}
  if process.returncode:
    print(process.stderr[-2000:], file=sys.stderr)
    return row
  return {**row, **_last_epoch(workdir)}


def _load(row: dict) -> str:
  """The load average before -> after the run, where the row has it (older rows do not)."""
  if 'load_before' not in row:
    return '-'
  return f"{row['load_before']:.1f} -> {row['load_after']:.1f}"


def _markdown(rows: list[dict]) -> str:
  percent = lambda value: '-' if value is None else f'{100 * value:.1f}%'
  lines = ['| recipe | kind | seed | held out | training | epochs | wall time | load | command |',
           '| --- | --- | --- | --- | --- | --- | --- | --- | --- |']
  for row in rows:
    lines.append(
        f"| {row['recipe']} | {row['kind']} | {row['seed']} | "
        f"{percent(row.get('held_out_accuracy'))} | {percent(row.get('train_accuracy'))} | "
        f"{row.get('epochs', '-')} | {row['wall_s']:.0f} s | {_load(row)} | `{row['command']}` |")
  return '\n'.join(lines) + '\n'


def main(argv):
  del argv
  path = FLAGS.out + '.json'
  rows = []
  if os.path.exists(path):
    with open(path, encoding='utf-8') as file:
      rows = json.load(file)
  for kind in FLAGS.kinds:
    for seed in map(int, FLAGS.seeds):
      row = _run(kind, seed)
      print(json.dumps(row), flush=True)
      rows.append(row)
      with open(path, 'w', encoding='utf-8') as file:  # After every run: a run can be long.
        json.dump(rows, file, indent=1)
      with open(FLAGS.out + '.md', 'w', encoding='utf-8') as file:
        file.write(_markdown(rows))


if __name__ == '__main__':
  app.run(main)
