"""Benchmarks this project against its PyTorch peer: the same CNN and optimizer, the same machine.

    python -m benchmarks.peer --rounds=3 --epochs=2 --json=peer.json

Needs the torch extra (requirements-extras.txt) and MNIST: prepared in $TFDS_DATA_DIR for
`main.py`, and the four original .gz files for the PyTorch peer (--mnist_dir, by default the
TFDS manual dir `$TFDS_DATA_DIR/downloads/manual`, README.md).

Configurations (--variants), each a fresh child process that trains for --epochs epochs and
evaluates the whole test split after every epoch:
  torch_eager, torch_autocast_bf16, torch_compile, torch_channels_last:
      `python -m benchmarks.pytorch_mnist --variant=...` (see that module), data in memory.
  project_{auto,off}_{float32,bfloat16}:
      `python main.py --config=configs/default.py --workdir=TMP --config.num_epochs=E`, with
      `--config.cpu_kernels=off` and `--config.compute_dtype=bfloat16` where named; its figures
      come from `<workdir>/metrics.jsonl` (`read_metrics`).
The configurations alternate round by round, so that a machine's speed drifting over the run
(shared cloud cores do) hits all of them alike; the table shows each figure's median over the
rounds, and --json keeps every round. Each torch.compile child compiles cold, in its own
inductor cache dir, as each JAX child does.

Figures per configuration: training examples/s of the last epoch (training steps only, eval
excluded); whole-process seconds, timed by this process from spawn to exit (start-up, data,
compilation, every epoch and eval, and exit); eval accuracy after the last epoch; and the share
of the CPU's limit its train step reaches: FLOPs per example x examples/s, over the FLOP/s of a
2048x2048 matmul measured in the same library and dtype (bfloat16 for torch_autocast_bf16 and
the project's compute_dtype=bfloat16, float32 for the rest). FLOPs per example of one train
step, forward and backward: PyTorch's `FlopCounterMode` (counts convolutions and matmuls only),
XLA's cost analysis for JAX (every op), as `benchmarks/benchmark.py` counts them, here of an
SGD step of `models.CNN` built from each configuration's layers. benchmark.py's own functions
are not imported: it defines flags of the same names (--json, --rounds) and imports TensorFlow
and the training code. The matmul peaks and FLOPs are measured each round in two more children,
one per library, so that neither library's CUDA or thread pools meet the other's.

The first line printed, and the JSON, name the CPU model and its ISA features (AVX2, AVX-512,
AVX512-BF16, AMX) with the core count and library versions: bfloat16 speed on CPU hangs on
them (without AVX512-BF16 or AMX, PyTorch's bfloat16 matmuls can run 100x slower than float32),
so figures from different machines must never be mixed.

GPU (--device=cuda): the PyTorch children train on CUDA and the project runs with its stock
layers (cpu_kernels=off) on JAX's GPU backend (the venv needs jax[cuda]); default
configurations: torch_eager, torch_autocast_bf16, torch_compile, project_off_float32,
project_off_bfloat16, and the matmul peaks are the GPU's, at each library's default matmul
precision (JAX's float32 default uses TF32 on recent GPUs, torch's does not; cuDNN convolutions
in torch do). One command, estimated at 4-6 minutes on an H100-class GPU (untested: this was
written on a machine without a GPU):

    python -m benchmarks.peer --device=cuda --rounds=1 --json=peer_cuda.json
"""

import collections
import dataclasses
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from absl import app
from absl import flags
from absl import logging

FLAGS = flags.FLAGS
flags.DEFINE_integer('rounds', 3, 'Alternating rounds of every configuration; figures are medians.',
                     lower_bound=1)
flags.DEFINE_integer('epochs', 2, 'Epochs each configuration trains for.', lower_bound=1)
flags.DEFINE_list('variants', None, 'Configurations to run (default: all for --device): '
                  'torch_{eager,autocast_bf16,compile,channels_last}, '
                  'project_{auto,off}_{float32,bfloat16}.')
flags.DEFINE_enum('device', 'cpu', ['cpu', 'cuda'], 'Where PyTorch and JAX train.')
flags.DEFINE_string('mnist_dir', None, 'Directory of the four original MNIST .gz files for the '
                    'PyTorch peer (default: $TFDS_DATA_DIR/downloads/manual).')
flags.DEFINE_integer('train_examples', None, 'Train on the first N training images (default: '
                     'all): for quick checks; the figures are for the whole split.')
flags.DEFINE_string('json', None, 'Where to write the figures.')
flags.mark_flag_as_required('json')
# Internal: a child that measures one library's matmul peaks and FLOPs per example.
flags.DEFINE_enum('measure', None, ['torch', 'jax'], "Measure one library's figures, in-process.")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH_SIZE = 128  # configs/default.py's and the PyTorch peer's.
MATMUL_SIZE = 2048
ISA_FEATURES = ('avx2', 'avx512f', 'avx512_bf16', 'amx_bf16', 'amx_tile')
# metrics.jsonl keys of an epoch end, and their names here.
_EPOCH_KEYS = {'epoch': 'epoch', 'train/examples_per_sec': 'train_examples_per_sec',
               'eval/accuracy': 'eval_accuracy'}


@dataclasses.dataclass(frozen=True)
class Configuration:
  """One program measured, by its name in the table."""
  name: str
  library: str  # 'torch' (benchmarks.pytorch_mnist) or 'jax' (main.py).
  dtype: str  # What its matmuls compute in: the peak it is compared with.
  option: str  # torch: its --variant; jax: its config.cpu_kernels.

  @property
  def child_flags(self) -> list[str]:
    """Its own flags, beside those every child of its library gets."""
    if self.library == 'torch':
      return [f'--variant={self.option}']
    return ((['--config.cpu_kernels=off'] if self.option == 'off' else [])
            + (['--config.compute_dtype=bfloat16'] if self.dtype == 'bfloat16' else []))


# benchmarks.pytorch_mnist's variants (a test checks that they match).
TORCH_VARIANTS = {'eager': 'float32', 'autocast_bf16': 'bfloat16', 'compile': 'float32',
                  'channels_last': 'float32'}
CONFIGURATIONS = {c.name: c for c in [
    *(Configuration(f'torch_{variant}', 'torch', dtype, variant)
      for variant, dtype in TORCH_VARIANTS.items()),
    *(Configuration(f'project_{cpu_kernels}_{dtype}', 'jax', dtype, cpu_kernels)
      for cpu_kernels in ('auto', 'off') for dtype in ('float32', 'bfloat16'))]}
DEFAULT_VARIANTS = {
    'cpu': list(CONFIGURATIONS),
    'cuda': ['torch_eager', 'torch_autocast_bf16', 'torch_compile', 'project_off_float32',
             'project_off_bfloat16']}


def parse_cpuinfo(cpuinfo: str) -> dict[str, str | bool]:
  """The CPU's model name and which of ISA_FEATURES it has, from /proc/cpuinfo's text."""
  fields = {}
  for line in cpuinfo.splitlines():
    key, colon, value = line.partition(':')
    if colon:
      fields.setdefault(key.strip(), value.strip())  # The first processor's.
  features = set(fields.get('flags', fields.get('Features', '')).split())  # x86; Arm.
  return {'cpu_model': fields.get('model name', 'unknown'),
          **{feature: feature in features for feature in ISA_FEATURES}}


def machine_info() -> dict[str, str | int | bool | None]:
  """The CPU (parse_cpuinfo), its cores and the library versions, without importing them."""
  try:
    with open('/proc/cpuinfo') as f:
      cpu = parse_cpuinfo(f.read())
  except OSError:
    cpu = parse_cpuinfo('')

  def version(package):
    try:
      return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      return None

  return {**cpu, 'cpu_count': os.cpu_count(), 'usable_cores': len(os.sched_getaffinity(0)),
          'torch': version('torch'), 'jax': version('jax'), 'jaxlib': version('jaxlib')}


def machine_line(machine: dict) -> str:
  """One line naming the CPU, its ISA features, cores and library versions."""
  features = ', '.join(f'{feature} {"yes" if machine[feature] else "no"}'
                       for feature in ISA_FEATURES)
  return (f'CPU: {machine["cpu_model"]}; {features}; {machine["usable_cores"]} cores usable '
          f'({machine["cpu_count"]} online); torch {machine["torch"]}, jax {machine["jax"]}')


def read_metrics(path: str) -> list[dict[str, float]]:
  """Every epoch end's figures from a `main.py` run's metrics.jsonl, in order.

  The file holds one JSON object per line, each with an integer "step" and scalar metrics; the
  lines of one step are merged. An epoch end is a step whose lines carry "epoch",
  "train/examples_per_sec" (training steps only) and "eval/accuracy".
  """
  steps = collections.defaultdict(dict)
  with open(path) as f:
    for line in f:
      if line.strip():
        record = json.loads(line)
        steps[record['step']].update(record)
  return [{'step': step, **{name: merged[key] for key, name in _EPOCH_KEYS.items()}}
          for step, merged in sorted(steps.items()) if _EPOCH_KEYS.keys() <= merged.keys()]


def best_seconds(fn: Callable[[], object], repeats: int = 10, budget_s: float = 10.0) -> float:
  """Seconds of the fastest of up to `repeats` calls of `fn` (which must block until done).

  The first call, a warm-up, counts too (the fastest is never it unless all are as slow), and
  the calls stop once they took `budget_s` in all: a bfloat16 matmul on a CPU without bfloat16
  instructions can take a minute.
  """
  times = []
  while len(times) < repeats and sum(times) < budget_s:
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def matmuls_per_timing(device: str) -> int:
  """Matmuls per timed call: one on a CPU; on a GPU, where a 2048x2048 matmul takes tens of
  microseconds, enough that the launch and the sync after them do not count."""
  return 1 if device == 'cpu' else 50


def measure_torch(device: str) -> dict:
  """PyTorch's matmul FLOP/s by dtype and FLOPs per example of one train step of its CNN."""
  # pylint: disable=g-import-not-at-top  (optional extra; only this child imports it)
  import torch
  from torch.nn import functional as F
  from torch.utils import flop_counter
  from benchmarks import pytorch_mnist
  # pylint: enable=g-import-not-at-top
  device = torch.device(device)

  def matmul_flops_per_sec(dtype):
    a = torch.ones(MATMUL_SIZE, MATMUL_SIZE, dtype=dtype, device=device)

    calls = matmuls_per_timing(device.type)

    def matmuls():
      for _ in range(calls):
        a @ a  # pylint: disable=pointless-statement
      pytorch_mnist.synchronize(device)

    return calls * 2 * MATMUL_SIZE**3 / best_seconds(matmuls)

  model = pytorch_mnist.CNN().to(device)
  images = torch.zeros(BATCH_SIZE, 1, 28, 28, device=device)
  labels = torch.zeros(BATCH_SIZE, dtype=torch.int64, device=device)
  with flop_counter.FlopCounterMode(display=False) as counter:
    F.cross_entropy(model(images), labels).backward()
  return {'matmul_gflops': {'float32': matmul_flops_per_sec(torch.float32) / 1e9,
                            'bfloat16': matmul_flops_per_sec(torch.bfloat16) / 1e9},
          'flops_per_example': counter.get_total_flops() / BATCH_SIZE,
          'device_name': (torch.cuda.get_device_name(device) if device.type == 'cuda'
                          else 'cpu')}


def measure_jax(device: str, configurations: list[Configuration]) -> dict:
  """JAX's matmul FLOP/s by dtype and, per project configuration, XLA's FLOPs per example of
  one SGD train step of models.CNN built from that configuration's layers."""
  # pylint: disable=g-import-not-at-top  (only this child starts JAX)
  from flax import nnx
  import jax
  import jax.numpy as jnp
  import optax

  import kernels
  import models
  # pylint: enable=g-import-not-at-top

  def matmul_flops_per_sec(dtype):
    a = jnp.ones((MATMUL_SIZE, MATMUL_SIZE), dtype)
    matmul = jax.jit(lambda a: a @ a)
    calls = matmuls_per_timing(device)

    def matmuls():
      for _ in range(calls - 1):
        matmul(a)  # Queued: JAX dispatches asynchronously.
      matmul(a).block_until_ready()

    return calls * 2 * MATMUL_SIZE**3 / best_seconds(matmuls)

  @nnx.jit
  def train_step(model, optimizer, images, labels):
    def loss_fn(model):
      logits = model(images)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    optimizer.update(model, nnx.grad(loss_fn)(model))

  def flops_per_example(configuration):
    layers = kernels.select_layers(configuration.option, compute_dtype=configuration.dtype)
    model = models.CNN((28, 28, 1), 10, layers=layers, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    images = jnp.zeros((BATCH_SIZE, 28, 28, 1))
    labels = jnp.zeros((BATCH_SIZE,), jnp.int32)
    cost = train_step.lower(model, optimizer, images, labels).compile().cost_analysis()
    return float(cost['flops']) / BATCH_SIZE

  return {'matmul_gflops': {'float32': matmul_flops_per_sec(jnp.float32) / 1e9,
                            'bfloat16': matmul_flops_per_sec(jnp.bfloat16) / 1e9},
          'flops_per_example': {c.name: flops_per_example(c) for c in configurations},
          'device_name': jax.devices()[0].device_kind}


def child_env(library: str, workdir: str) -> dict[str, str]:
  """The environment of a child of `library` ('torch' or 'jax') working in `workdir`."""
  if library == 'torch':
    # A fresh inductor cache: torch.compile compiles cold in every child, as JAX does.
    return {**os.environ, 'TORCHINDUCTOR_CACHE_DIR': os.path.join(workdir, 'inductor')}
  # A JAX without its CUDA plugin would otherwise run the 'cuda' configurations on the CPU.
  return {**os.environ, 'JAX_PLATFORMS': FLAGS.device}


def run_child(command: list[str], env: dict[str, str]) -> float:
  """Runs `command` from the repository root; returns the seconds from spawn to exit."""
  start = time.perf_counter()
  result = subprocess.run(command, cwd=_ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  seconds = time.perf_counter() - start
  if result.returncode:
    raise RuntimeError(f'{" ".join(command)} failed with status {result.returncode}; its output '
                       f'ends:\n{result.stdout[-3000:]}')
  return seconds


def measure_library(library: str, configurations: list[Configuration]) -> dict:
  """`measure_torch` or `measure_jax` (for the project `configurations`) in a fresh child."""
  with tempfile.TemporaryDirectory() as workdir:
    out = os.path.join(workdir, 'figures.json')
    run_child([sys.executable, '-m', 'benchmarks.peer', f'--measure={library}',
               f'--device={FLAGS.device}', f'--json={out}',
               f'--variants={",".join(c.name for c in configurations)}'],
              child_env(library, workdir))
    with open(out) as f:
      return json.load(f)


def mnist_dir() -> str:
  """--mnist_dir, or the TFDS manual dir where README.md puts the original files."""
  if FLAGS.mnist_dir:
    return FLAGS.mnist_dir
  data_dir = os.environ.get('TFDS_DATA_DIR', os.path.expanduser('~/tensorflow_datasets'))
  return os.path.join(data_dir, 'downloads', 'manual')


def run_configuration(configuration: Configuration) -> dict:
  """Trains `configuration` in a fresh child; its figures per epoch and of the last epoch."""
  with tempfile.TemporaryDirectory() as workdir:
    if configuration.library == 'torch':
      out = os.path.join(workdir, 'figures.json')
      subset = [f'--train_examples={FLAGS.train_examples}'] if FLAGS.train_examples else []
      command = [sys.executable, '-m', 'benchmarks.pytorch_mnist', *configuration.child_flags,
                 f'--epochs={FLAGS.epochs}', f'--mnist_dir={mnist_dir()}',
                 f'--device={FLAGS.device}', f'--json={out}', *subset]
    else:
      out = os.path.join(workdir, 'metrics.jsonl')
      subset = ([f'--config.train_split=train[:{FLAGS.train_examples}]']
                if FLAGS.train_examples else [])
      command = [sys.executable, 'main.py', '--config=configs/default.py',
                 f'--workdir={workdir}', f'--config.num_epochs={FLAGS.epochs}',
                 *configuration.child_flags, *subset]
    seconds = run_child(command, child_env(configuration.library, workdir))
    if configuration.library == 'torch':
      with open(out) as f:
        child = json.load(f)
      epochs = child.pop('epochs')
    else:
      child, epochs = {}, read_metrics(out)
  if len(epochs) != FLAGS.epochs:
    raise RuntimeError(f'{configuration.name} reported {len(epochs)} epoch ends, not '
                       f'{FLAGS.epochs}: {epochs}')
  return {'train_examples_per_sec': epochs[-1]['train_examples_per_sec'],
          'process_seconds': seconds, 'eval_accuracy': epochs[-1]['eval_accuracy'],
          'every_epoch': epochs, **child}


def median(values: list[float]) -> float:
  """The median of `values`, as a float for JSON."""
  return float(statistics.median(values))


def summarize(configurations: list[Configuration], every_round: dict[str, list[dict]],
              libraries: dict[str, list[dict]]) -> dict[str, dict]:
  """Each configuration's median figures and its share of its library's matmul peak.

  `every_round` holds each configuration's runs, `libraries` each library's measurements
  (`measure_torch`, `measure_jax`), one per round.
  """
  matmul_gflops = {library: {dtype: median([measured['matmul_gflops'][dtype]
                                            for measured in rounds])
                             for dtype in ('float32', 'bfloat16')}
                   for library, rounds in libraries.items()}
  runs = {}
  for c in configurations:
    figures = {key: median([run[key] for run in every_round[c.name]])
               for key in ('train_examples_per_sec', 'process_seconds', 'eval_accuracy')}
    flops = libraries[c.library][0]['flops_per_example']  # The same in every round.
    flops = flops if c.library == 'torch' else flops[c.name]
    achieved = flops * figures['train_examples_per_sec'] / 1e9
    peak = matmul_gflops[c.library][c.dtype]
    runs[c.name] = {**figures, 'flops_per_example': flops, 'achieved_gflops': achieved,
                    'matmul_peak_gflops': peak, 'share_of_matmul_peak': achieved / peak}
  return {'matmul_gflops': matmul_gflops, 'runs': runs}


def markdown_table(configurations: list[Configuration], runs: dict[str, dict],
                   epochs: int) -> str:
  """The table of `runs` (summarize's), a row per configuration."""
  lines = [f'| configuration | train examples/s (epoch {epochs}) | process seconds (epochs 1-'
           f'{epochs}) | eval accuracy (epoch {epochs}) | FLOPs/example (train step) | share of '
           'matmul peak (library, dtype: GFLOP/s) |', '| --- | ---: | ---: | ---: | ---: | ---: |']
  for c in configurations:
    run = runs[c.name]
    lines.append(
        f'| {c.name} | {run["train_examples_per_sec"]:,.0f} | {run["process_seconds"]:,.1f} | '
        f'{run["eval_accuracy"]:.4f} | {run["flops_per_example"] / 1e6:.1f}M | '
        f'{run["share_of_matmul_peak"]:.1%} ({c.library}, {c.dtype}: '
        f'{run["matmul_peak_gflops"]:,.1f}) |')
  return '\n'.join(lines)


def selected_configurations() -> list[Configuration]:
  """The configurations --variants names, by default those of --device."""
  names = DEFAULT_VARIANTS[FLAGS.device] if FLAGS.variants is None else FLAGS.variants
  unknown = [name for name in names if name not in CONFIGURATIONS]
  if unknown:
    raise app.UsageError(f'Unknown --variants {unknown}: choose from {list(CONFIGURATIONS)}.')
  return [CONFIGURATIONS[name] for name in names]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  configurations = selected_configurations()
  if FLAGS.measure:
    figures = (measure_torch(FLAGS.device) if FLAGS.measure == 'torch' else
               measure_jax(FLAGS.device, [c for c in configurations if c.library == 'jax']))
    with open(FLAGS.json, 'w') as f:
      json.dump(figures, f)
    return

  if not configurations:
    raise app.UsageError('--variants names no configuration.')
  machine = machine_info()
  print(machine_line(machine), flush=True)
  project = [c for c in configurations if c.library == 'jax']
  every_round = collections.defaultdict(list)
  libraries = collections.defaultdict(list)
  for round_index in range(1, FLAGS.rounds + 1):
    for library in ('torch', 'jax'):
      libraries[library].append(measure_library(library, project))
      logging.info('round %d: %s matmul GFLOP/s %s', round_index, library,
                   libraries[library][-1]['matmul_gflops'])
    for c in configurations:
      every_round[c.name].append(run_configuration(c))
      logging.info('round %d %s: %.0f training examples/s, %.1f s, eval accuracy %.4f',
                   round_index, c.name, every_round[c.name][-1]['train_examples_per_sec'],
                   every_round[c.name][-1]['process_seconds'],
                   every_round[c.name][-1]['eval_accuracy'])
  summary = summarize(configurations, every_round, libraries)
  device_names = {library: rounds[0]['device_name'] for library, rounds in libraries.items()}
  print(f'\nMedians of {FLAGS.rounds} round(s), {FLAGS.epochs} epoch(s) each, on {FLAGS.device} '
        f'(torch: {device_names["torch"]}, jax: {device_names["jax"]}):\n')
  print(markdown_table(configurations, summary['runs'], FLAGS.epochs))
  print('\n2048x2048 matmul GFLOP/s: ' + '; '.join(
      f'{library} ' + ', '.join(f'{dtype} {gflops:,.1f}' for dtype, gflops in by_dtype.items())
      for library, by_dtype in summary['matmul_gflops'].items()))
  print('FLOPs/example: torch by FlopCounterMode (convolutions and matmuls), jax by XLA cost '
        'analysis (every op).')
  report = {'machine': machine, 'device': FLAGS.device, 'device_names': device_names,
            'epochs': FLAGS.epochs, 'rounds': FLAGS.rounds,
            'train_examples': FLAGS.train_examples, **summary,
            'every_round': {'runs': every_round, 'libraries': libraries}}
  with open(FLAGS.json, 'w') as f:
    json.dump(report, f, indent=2)


if __name__ == '__main__':
  app.run(main)
