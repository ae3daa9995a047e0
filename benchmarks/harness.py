"""What every benchmark shares: timing, child processes, metrics of a run, tables, the machine,
and the JSON artefact that a figure in the docs comes from.

A figure's artefact (`write_json`) records, beside the figures, the command that wrote it (rerun
it to regenerate the file), the git commit, the machine (CPU model and the ISA features that
decide bfloat16 speed on a CPU, cores, library versions) and the date. Never edit one by hand.

Imports no JAX, TensorFlow or PyTorch at module level: a parent process that only runs children
(backbones.py, record.py) stays light, and each child imports what it measures.
"""

import collections
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The lscpu flags that bfloat16 speed on a CPU hangs on (without AVX512-BF16 or AMX, bfloat16 is
# emulated: PyTorch's bfloat16 matmuls can run 100x slower than float32).
ISA_FEATURES = ('avx2', 'avx512f', 'avx512_bf16', 'amx_bf16', 'amx_tile')
MATMUL_SIZE = 2048
_OUTPUT_LINES_KEPT = 100  # Of a child's output, for the error when it fails.


# Timing.

def time_calls(fn: Callable[[], object], calls: int, budget_s: float = math.inf) -> list[float]:
  """Seconds of each of up to `calls` calls of `fn` (which must block until its work is done),
  stopping once they took `budget_s` in all (a bfloat16 matmul on a CPU without bfloat16 units
  can take a minute); at least one."""
  times = []
  while len(times) < calls and (not times or sum(times) < budget_s):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return times


def best_seconds(fn: Callable[[], object], repeats: int = 5, budget_s: float = math.inf) -> float:
  """Seconds of the fastest call of `time_calls(fn, repeats, budget_s)`: the first, a warm-up,
  counts too (it is never the fastest unless all are as slow)."""
  return min(time_calls(fn, repeats, budget_s))


def matmul_flops_per_sec(dtype: str = 'float32', size: int = MATMUL_SIZE) -> float:
  """FLOP/s of a `size` x `size` matmul in JAX in `dtype`: the peak a train step's FLOP/s is put
  against on a CPU."""
  import jax  # pylint: disable=g-import-not-at-top  (only the processes that measure JAX)
  a = jax.numpy.ones((size, size), dtype)
  matmul = jax.jit(lambda a: a @ a)
  matmul(a).block_until_ready()
  return 2 * size**3 / best_seconds(lambda: matmul(a).block_until_ready(), repeats=10,
                                    budget_s=10.0)


def median(values: Iterable[float]) -> float:
  """The median of `values`, as a float for JSON."""
  return float(statistics.median(values))


# Child processes.

@dataclasses.dataclass(frozen=True)
class Child:
  """A finished child process: its wall time (spawn to exit), peak RSS, exit code and the end of
  its output (stdout and stderr, interleaved)."""
  seconds: float
  peak_rss_mb: float
  returncode: int
  output_tail: str


def run_child(command: Sequence[str], *, env: dict[str, str] | None = None, echo: bool = False,
              log_path: str | None = None, stop: Callable[[str], bool] | None = None,
              check: bool = True) -> Child:
  """Runs `command` from the repository root and waits for it.

  Each child gets a fresh, empty PyTorch inductor cache and JAX compilation cache (unless its
  environment names one: `$JAX_COMPILATION_CACHE_DIR`, as the tests share one, or a benchmark of
  warm starts), so that every child compiles cold. `echo` prints its output as it comes, and `log_path` gets all of
  it; `stop(line)` is called on each line of it, and the child is terminated once it returns
  True. With `check`, a child that fails (other than by that stop) raises RuntimeError with the
  end of its output.
  """
  env = env or os.environ
  with (tempfile.TemporaryDirectory() as inductor_cache,
        tempfile.TemporaryDirectory() as jax_cache,
        open(log_path or os.devnull, 'w', encoding='utf-8') as log):
    start = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=ROOT, env={'JAX_COMPILATION_CACHE_DIR': jax_cache, **env,
                                'TORCHINDUCTOR_CACHE_DIR': inductor_cache},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail, stopped = collections.deque(maxlen=_OUTPUT_LINES_KEPT), False
    for line in process.stdout:
      tail.append(line)
      log.write(line)
      if echo:
        print(line, end='', flush=True)
      if stop is not None and stop(line):
        process.terminate()
        stopped = True
        break
    process.stdout.close()
    # wait4, not wait: the child's own resource usage (its peak RSS), not all children's.
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
  child = Child(seconds, usage.ru_maxrss / 1024, process.returncode, ''.join(tail))
  if check and child.returncode and not stopped:
    raise RuntimeError(f'{shlex.join(command)} failed with status {child.returncode}; its '
                       f'output ends:\n{child.output_tail}')
  return child


def jax_child_env(device: str) -> dict[str, str]:
  """The environment of a child that runs JAX on `device` ('cpu', 'cuda' or 'tpu'), the CPU
  beside it as in a user's process: a JAX without its CUDA plugin would otherwise run a 'cuda'
  measurement on the CPU."""
  return {**os.environ, 'JAX_PLATFORMS': device if device == 'cpu' else f'{device},cpu'}


def json_child(command: Sequence[str], env: dict[str, str] | None = None) -> tuple[dict, Child]:
  """Runs `command --json=<a temporary file>` (`run_child`); the figures it wrote there."""
  with tempfile.TemporaryDirectory() as directory:
    out = os.path.join(directory, 'figures.json')
    child = run_child([*command, f'--json={out}'], env=env)
    with open(out, encoding='utf-8') as file:
      return json.load(file), child


def read_metrics(workdir: str) -> list[dict[str, float]]:
  """Every step a `main.py` run wrote to its metrics.jsonl, in order: {'step': N, name: value}
  (the app's own reader, `training.summaries.read_metrics`)."""
  from training import summaries  # pylint: disable=g-import-not-at-top  (imports TensorFlow)
  return [{'step': step, **values}
          for step, values in sorted(summaries.read_metrics(workdir).items())]


def final_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
  """Each metric's last value over `steps` (read_metrics's), with the last step."""
  final = {}
  for values in steps:
    final.update(values)
  return final


# Tables.

def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]],
                   align: str = '') -> str:
  """A markdown table; `align` has a letter per column, 'l' or 'r' (numbers), 'l' if missing."""
  rule = ['---:' if align[i:i + 1] == 'r' else '---' for i in range(len(header))]
  return '\n'.join('| ' + ' | '.join(str(cell) for cell in cells) + ' |'
                   for cells in [header, rule, *rows])


# The machine and the artefact.

def parse_lscpu(text: str) -> dict[str, str | bool]:
  """The CPU's model name, family and model number, and which of ISA_FEATURES it has, from
  `lscpu`'s output. A cloud VM's name can be the vendor's line alone ('AMD EPYC'): its family
  and model number tell the generation (AMD's family 25 model 17 is Zen 4, Genoa)."""
  fields = {name.strip(): value.strip() for name, value in
            (line.split(':', 1) for line in text.splitlines() if ':' in line)}
  features = set(fields.get('Flags', '').split())
  return {'cpu_model': fields.get('Model name', 'unknown'),
          'cpu_family': fields.get('CPU family', 'unknown'),
          'cpu_model_number': fields.get('Model', 'unknown'),
          **{feature: feature in features for feature in ISA_FEATURES}}


def machine() -> dict[str, str | int | bool | None]:
  """The CPU (parse_lscpu), its cores and the library versions, without importing them."""
  try:
    lscpu = subprocess.run(['lscpu'], capture_output=True, text=True, check=False,
                           env={**os.environ, 'LC_ALL': 'C'}).stdout  # English field names.
  except OSError:  # No lscpu (not Linux): the model is 'unknown'.
    lscpu = ''

  def version(package):
    try:
      return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      return None

  return {**parse_lscpu(lscpu), 'cpu_count': os.cpu_count(),
          'usable_cores': len(os.sched_getaffinity(0)),
          **{package: version(package) for package in ('jax', 'jaxlib', 'libtpu', 'torch')}}


def machine_line(described: dict) -> str:
  """One line naming the CPU, its ISA features, cores and library versions (`machine()`'s)."""
  features = ', '.join(f'{feature} {"yes" if described[feature] else "no"}'
                       for feature in ISA_FEATURES)
  return (f'CPU: {described["cpu_model"]} (family {described["cpu_family"]}, '
          f'model {described["cpu_model_number"]}); {features}; '
          f'{described["usable_cores"]} cores usable '
          f'({described["cpu_count"]} online); torch {described["torch"]}, '
          f'jax {described["jax"]}')


def command_line(argv: Sequence[str]) -> str:
  """`argv` as a shell command that reruns it from the repository root: a benchmark's file is
  named as its module (`python -m benchmarks.backbones ...`)."""
  program = os.path.relpath(os.path.abspath(argv[0]), ROOT)
  if program.startswith('benchmarks' + os.sep) and program.endswith('.py'):
    return shlex.join(['python', '-m', program[:-3].replace(os.sep, '.'), *argv[1:]])
  return shlex.join(['python', *argv])


def git_commit(artefact: str = '') -> dict[str, str | bool | None]:
  """The checkout's commit, and whether tracked files other than `artefact` (rewritten as the
  run goes) differ from it (the figures are then of that commit plus those changes)."""
  def git(*args):
    result = subprocess.run(['git', *args], cwd=ROOT, capture_output=True, text=True,
                            check=False)
    return result.stdout.strip() if result.returncode == 0 else None
  commit = git('rev-parse', 'HEAD')
  inside = artefact and os.path.abspath(artefact).startswith(os.path.join(ROOT, ''))
  excluded = [f':!{os.path.relpath(os.path.abspath(artefact), ROOT)}'] if inside else []
  # git refuses a pathspec outside the checkout (an artefact written elsewhere), and where git
  # cannot tell, the changes are unknown (None), not none.
  status = git('status', '--porcelain', '--untracked-files=no', '--', '.', *excluded)
  return {'commit': commit,
          'uncommitted_changes': bool(status) if commit and status is not None else None}


def utc_now() -> str:
  """The date and time in UTC, to the second (ISO 8601)."""
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')


def provenance(artefact: str = '') -> dict:
  """What an artefact records beside its figures: command, commit, machine, date (UTC), and
  the environment's XLA flags (they change what XLA:CPU compiles) and glibc tunables (they
  change how malloc serves XLA's memory), each None if unset."""
  return {'command': command_line(sys.argv), **git_commit(artefact), 'machine': machine(),
          'date': utc_now(), 'xla_flags': os.environ.get('XLA_FLAGS'),
          'glibc_tunables': os.environ.get('GLIBC_TUNABLES')}


def write_json(path: str, figures: dict) -> None:
  """Writes `figures` with their `provenance()` to `path`, whole or not at all (a run stopped
  while writing leaves the previous file)."""
  temporary = f'{path}.tmp'
  with open(temporary, 'w', encoding='utf-8') as file:
    json.dump({**provenance(path), **figures}, file, indent=2)
    file.write('\n')
  os.replace(temporary, path)
