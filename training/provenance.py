"""Where a workdir's model came from: `<workdir>/provenance.json`, written when training starts.

Each start of training (a new run or a resumed one) adds a record: the time, the Python and
package versions, the code's git commit (and whether the checkout had uncommitted changes), and
the data's fingerprint (source, dataset, split sizes, class names, image shape; for an image
folder a hash of its file list, for a CSV source a hash of the CSV file). Earlier records are
kept, so a resumed run never hides what the first one trained on; one whose data fingerprint
differs from the previous record's says what changed in one warning line. The model card of an
export (modes/model_card.py) reports these records.
"""

import datetime
import hashlib
import importlib
import json
import os
import platform
import subprocess

from absl import logging
import jax

from data_sources import base
from data_sources import image_files
from training import run_spec
from training import workdirs

PROVENANCE_FILE = 'provenance.json'  # {"records": [record, ...]}, oldest first.
# Distribution name -> the module whose __version__ it is (tensorflow is installed as
# tensorflow-cpu here, so distribution metadata would miss it).
PACKAGES = {'jax': 'jax', 'jaxlib': 'jaxlib', 'flax': 'flax', 'optax': 'optax',
            'orbax-checkpoint': 'orbax.checkpoint', 'tensorflow': 'tensorflow',
            'numpy': 'numpy'}
CODE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GIT_TIMEOUT_S = 10


def environment() -> dict:
  """The Python and package versions, the processor and the code's git state, as of now."""
  return {'python': platform.python_version(),
          'packages': {name: getattr(importlib.import_module(module), '__version__', None)
                       for name, module in PACKAGES.items()},
          'processor': processor(),
          'git': git_state()}


def processor() -> str:
  """The CPU's model name (Linux's /proc/cpuinfo, as `lscpu` shows it), else what Python's
  `platform` knows (often only the architecture)."""
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as file:
      for line in file:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def git_state(directory: str = CODE_DIR) -> dict | None:
  """{'commit': sha, 'dirty': bool} of the checkout holding `directory`; None outside one
  (or without git). Untracked files do not make it dirty: workdirs often live in the checkout."""
  try:
    commit = subprocess.run(['git', '-C', directory, 'rev-parse', 'HEAD'], capture_output=True,
                            text=True, timeout=_GIT_TIMEOUT_S, check=True).stdout.strip()
    status = subprocess.run(['git', '-C', directory, 'status', '--porcelain',
                             '--untracked-files=no'], capture_output=True, text=True,
                            timeout=_GIT_TIMEOUT_S, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return None
  return {'commit': commit, 'dirty': bool(status.strip())}


def data_fingerprint(run: run_spec.Run, info: base.DatasetInfo) -> dict:
  """What identifies the training data: the run's source and splits with their sizes as the
  data reported them, the class names and image shape; for local files, a hash of them."""
  splits = {evaluation.name: evaluation.split for evaluation in run.evaluations}
  fingerprint = {
      'source': run.data_source, 'dataset': run.dataset,
      'splits': {run.input.train_split: info.num_train_examples,
                 splits['eval']: info.num_eval_examples},
      'class_names': list(info.class_names), 'image_shape': list(info.image_shape)}
  if 'test' in splits:
    fingerprint['splits'][splits['test']] = info.num_test_examples
  if run.data_source == 'folder':
    fingerprint['files_sha256'] = _files_digest(run.dataset)
  elif run.data_source == 'csv':
    fingerprint['csv_sha256'] = _file_digest(run.dataset)
  return fingerprint


def _files_digest(root: str) -> str:
  """SHA-256 of every file's path under `root` (relative, so a moved folder keeps it) and
  byte size: a cheap listing, no image is read."""
  digest = hashlib.sha256()
  for path in image_files.find_files(root):
    digest.update(f'{os.path.relpath(path, root)}\0{os.path.getsize(path)}\n'.encode())
  return digest.hexdigest()


def _file_digest(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as file:
    for block in iter(lambda: file.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


def records(workdir: str) -> list[dict]:
  """The provenance records of `workdir`, oldest first ([] if none)."""
  path = os.path.join(workdir, PROVENANCE_FILE)
  if not os.path.exists(path):
    return []
  with open(path, encoding='utf-8') as file:
    return json.load(file)['records']


def record_start(workdir: str, run: run_spec.Run, info: base.DatasetInfo) -> dict:
  """Adds this start's record to `workdir`'s provenance (process 0 writes it) and returns it;
  warns in one line when the data's fingerprint differs from the previous record's."""
  record = {'started': datetime.datetime.now().isoformat(timespec='seconds'),
            **environment(), 'data': data_fingerprint(run, info)}
  earlier = records(workdir)
  if earlier and (changed := _changes(earlier[-1]['data'], record['data'])):
    logging.warning('The data differs from what %s was trained on before (%s): %s.',
                    workdir, earlier[-1]['started'], '; '.join(changed))
  if jax.process_index() == 0:
    workdirs.write_json(os.path.join(workdir, PROVENANCE_FILE),
                        {'records': earlier + [record]})
  return record


def _changes(old: dict, new: dict) -> list[str]:
  """'key: old -> new' for each field of the fingerprint that differs (as JSON, keys sorted as
  the file stores them)."""
  shown = lambda value: json.dumps(value, sort_keys=True)
  return [f'{key}: {shown(old.get(key))} -> {shown(new.get(key))}'
          for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]
