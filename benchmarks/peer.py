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
      `--config.kernels=stock` and `--config.compute_dtype=bfloat16` where named; its figures
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
SGD step of `models.CNN` built from each configuration's layers. The matmul peaks and FLOPs
are measured each round in one more child per library run, so that neither library's CUDA or
thread pools meet the other's.

The first line printed, and the JSON (`harness.write_json`), name the CPU model and its ISA
features (AVX2, AVX-512, AVX512-BF16, AMX) with the core count and library versions: bfloat16
speed on CPU hangs on them, so figures from different machines must never be mixed.

GPU (--device=cuda): the PyTorch children train on CUDA and the project runs with its stock
layers (kernels=stock) on JAX's GPU backend (the venv needs jax[cuda]); default
configurations: torch_eager, torch_autocast_bf16, torch_compile, project_off_float32,
project_off_bfloat16, and the matmul peaks are the GPU's, at each library's default matmul
precision (JAX's float32 default uses TF32 on recent GPUs, torch's does not; cuDNN convolutions
in torch do). One command, estimated at 4-6 minutes on an H100-class GPU (untested: this was
written on a machine without a GPU):

    python -m benchmarks.peer --device=cuda --rounds=1 --json=peer_cuda.json
"""

import collections
import dataclasses
import json
import os
import sys
import tempfile

from absl import app
from absl import flags
from absl import logging

from benchmarks import harness

FLAGS = flags.FLAGS
BATCH_SIZE = 128  # configs/default.py's and the PyTorch peer's.
# metrics.jsonl keys of an epoch end, and their names here.
_EPOCH_KEYS = {'epoch': 'epoch', 'train/examples_per_sec': 'train_examples_per_sec',
               'eval/accuracy': 'eval_accuracy'}


def define_flags() -> None:
  """The command line's flags: defined when run, not at import (tests import the module
  beside other benchmarks, whose flags share names)."""
  flags.DEFINE_integer('rounds', 3, 'Alternating rounds of every configuration; figures are '
                       'medians.', lower_bound=1)
  flags.DEFINE_integer('epochs', 2, 'Epochs each configuration trains for.', lower_bound=1)
  flags.DEFINE_list('variants', None, 'Configurations to run (default: all for --device): '
                    'torch_{eager,autocast_bf16,compile,channels_last}, '
                    'project_{auto,off}_{float32,bfloat16}.')
  flags.DEFINE_enum('device', 'cpu', ['cpu', 'cuda'], 'Where PyTorch and JAX train.')
  flags.DEFINE_string('mnist_dir', None, 'Directory of the four original MNIST .gz files for the '
                      'PyTorch peer (default: $TFDS_DATA_DIR/downloads/manual).')
  flags.DEFINE_integer('train_examples', None, 'Train on the first N training images (default: '
                       'all): for quick checks; the figures are for the whole split.')
  flags.DEFINE_integer('eval_examples', None, 'Evaluate on the first N test images (default: '
                       'all): for quick checks, as --train_examples.', lower_bound=1)
  flags.DEFINE_integer('matmul_size', harness.MATMUL_SIZE, "Side of the square matmul whose "
                       "FLOP/s is each library's peak (small: quick checks).", lower_bound=1)
  flags.DEFINE_string('json', None, 'Where to write the figures.')
  flags.mark_flag_as_required('json')
  # Internal: a child that measures one library's matmul peaks and FLOPs per example.
  flags.DEFINE_enum('measure', None, ['torch', 'jax'],
                    "Measure one library's figures, in-process.")


@dataclasses.dataclass(frozen=True)
class Configuration:
  """One program measured, by its name in the table."""
  name: str
  library: str  # 'torch' (benchmarks.pytorch_mnist) or 'jax' (main.py).
  dtype: str  # What its matmuls compute in: the peak it is compared with.
  option: str  # torch: its --variant; jax: 'auto' or 'off' (config.kernels='stock').

  @property
  def child_flags(self) -> list[str]:
    """Its own flags, beside those every child of its library gets."""
    if self.library == 'torch':
      return [f'--variant={self.option}']
    return ((['--config.kernels=stock'] if self.option == 'off' else [])
            + (['--config.compute_dtype=bfloat16'] if self.dtype == 'bfloat16' else []))


# benchmarks.pytorch_mnist's variants (a test checks that they match).
TORCH_VARIANTS = {'eager': 'float32', 'autocast_bf16': 'bfloat16', 'compile': 'float32',
                  'channels_last': 'float32'}
CONFIGURATIONS = {c.name: c for c in [
    *(Configuration(f'torch_{variant}', 'torch', dtype, variant)
      for variant, dtype in TORCH_VARIANTS.items()),
    *(Configuration(f'project_{layers}_{dtype}', 'jax', dtype, layers)
      for layers in ('auto', 'off') for dtype in ('float32', 'bfloat16'))]}
DEFAULT_VARIANTS = {
    'cpu': list(CONFIGURATIONS),
    'cuda': ['torch_eager', 'torch_autocast_bf16', 'torch_compile', 'project_off_float32',
             'project_off_bfloat16']}


def epoch_ends(workdir: str) -> list[dict[str, float]]:
  """Every epoch end's figures from a `main.py` run's metrics.jsonl, in order: the steps whose
  writes carry "epoch", "train/examples_per_sec" (training steps only) and "eval/accuracy"."""
  return [{'step': values['step'], **{name: values[key] for key, name in _EPOCH_KEYS.items()}}
          for values in harness.read_metrics(workdir) if _EPOCH_KEYS.keys() <= values.keys()]


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
    size = FLAGS.matmul_size
    a = torch.ones(size, size, dtype=dtype, device=device)
    calls = matmuls_per_timing(device.type)

    def matmuls():
      for _ in range(calls):
        a @ a  # pylint: disable=pointless-statement
      pytorch_mnist.synchronize(device)

    return calls * 2 * size**3 / harness.best_seconds(matmuls, repeats=10, budget_s=10.0)

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

  calls = matmuls_per_timing(device)
  return {'matmul_gflops': {
              dtype: harness.matmul_flops_per_sec(dtype, FLAGS.matmul_size, calls) / 1e9
              for dtype in ('float32', 'bfloat16')},
          'flops_per_example': {c.name: flops_per_example(c) for c in configurations},
          'device_name': jax.devices()[0].device_kind}


def child_env(library: str) -> dict[str, str] | None:
  """The environment of a child of `library` ('torch' or 'jax')."""
  return harness.jax_child_env(FLAGS.device) if library == 'jax' else None


def measure_library(library: str, configurations: list[Configuration]) -> dict:
  """`measure_torch` or `measure_jax` (for the project `configurations`) in a fresh child."""
  figures, _ = harness.json_child(
      [sys.executable, '-m', 'benchmarks.peer', f'--measure={library}', f'--device={FLAGS.device}',
       f'--matmul_size={FLAGS.matmul_size}',
       f'--variants={",".join(c.name for c in configurations)}'], child_env(library))
  return figures


def mnist_dir() -> str:
  """--mnist_dir, or the TFDS manual dir where README.md puts the original files."""
  if FLAGS.mnist_dir:
    return FLAGS.mnist_dir
  data_dir = os.environ.get('TFDS_DATA_DIR', os.path.expanduser('~/tensorflow_datasets'))
  return os.path.join(data_dir, 'downloads', 'manual')


def run_configuration(configuration: Configuration) -> dict:
  """Trains `configuration` in a fresh child; its figures per epoch and of the last epoch."""
  if configuration.library == 'torch':
    subset = [f'--train_examples={FLAGS.train_examples}'] if FLAGS.train_examples else []
    subset += [f'--eval_examples={FLAGS.eval_examples}'] if FLAGS.eval_examples else []
    child, process = harness.json_child(
        [sys.executable, '-m', 'benchmarks.pytorch_mnist', *configuration.child_flags,
         f'--epochs={FLAGS.epochs}', f'--mnist_dir={mnist_dir()}', f'--device={FLAGS.device}',
         *subset], child_env('torch'))
    epochs = child.pop('epochs')
  else:
    subset = ([f'--config.train_split=train[:{FLAGS.train_examples}]']
              if FLAGS.train_examples else [])
    subset += ([f'--config.eval_split=test[:{FLAGS.eval_examples}]']
               if FLAGS.eval_examples else [])
    with tempfile.TemporaryDirectory() as workdir:
      process = harness.run_child(
          [sys.executable, 'main.py', '--config=configs/default.py', f'--workdir={workdir}',
           f'--config.num_epochs={FLAGS.epochs}', *configuration.child_flags, *subset],
          env=child_env('jax'))
      child, epochs = {}, epoch_ends(workdir)
  if len(epochs) != FLAGS.epochs:
    raise RuntimeError(f'{configuration.name} reported {len(epochs)} epoch ends, not '
                       f'{FLAGS.epochs}: {epochs}')
  return {'train_examples_per_sec': epochs[-1]['train_examples_per_sec'],
          'process_seconds': process.seconds, 'eval_accuracy': epochs[-1]['eval_accuracy'],
          'every_epoch': epochs, **child}


def summarize(configurations: list[Configuration], every_round: dict[str, list[dict]],
              libraries: dict[str, list[dict]]) -> dict[str, dict]:
  """Each configuration's median figures and its share of its library's matmul peak.

  `every_round` holds each configuration's runs, `libraries` each library's measurements
  (`measure_torch`, `measure_jax`), one per round.
  """
  matmul_gflops = {library: {dtype: harness.median([measured['matmul_gflops'][dtype]
                                            for measured in rounds])
                             for dtype in ('float32', 'bfloat16')}
                   for library, rounds in libraries.items()}
  runs = {}
  for c in configurations:
    figures = {key: harness.median([run[key] for run in every_round[c.name]])
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
  return harness.markdown_table(
      ['configuration', f'train examples/s (epoch {epochs})',
       f'process seconds (epochs 1-{epochs})', f'eval accuracy (epoch {epochs})',
       'FLOPs/example (train step)', 'share of matmul peak (library, dtype: GFLOP/s)'],
      [[c.name, f'{runs[c.name]["train_examples_per_sec"]:,.0f}',
        f'{runs[c.name]["process_seconds"]:,.1f}', f'{runs[c.name]["eval_accuracy"]:.4f}',
        f'{runs[c.name]["flops_per_example"] / 1e6:.1f}M',
        f'{runs[c.name]["share_of_matmul_peak"]:.1%} ({c.library}, {c.dtype}: '
        f'{runs[c.name]["matmul_peak_gflops"]:,.1f})'] for c in configurations],
      align='lrrrrr')


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
    with open(FLAGS.json, 'w', encoding='utf-8') as file:
      json.dump(figures, file)
    return

  if not configurations:
    raise app.UsageError('--variants names no configuration.')
  print(harness.machine_line(harness.machine()), flush=True)
  project = [c for c in configurations if c.library == 'jax']
  every_round = collections.defaultdict(list)
  libraries = collections.defaultdict(list)
  for round_index in range(1, FLAGS.rounds + 1):
    for library in sorted({c.library for c in configurations}, reverse=True):  # torch first.
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
        f'({", ".join(f"{library}: {name}" for library, name in device_names.items())}):\n')
  print(markdown_table(configurations, summary['runs'], FLAGS.epochs))
  print(f'\n{FLAGS.matmul_size}x{FLAGS.matmul_size} matmul GFLOP/s: ' + '; '.join(
      f'{library} ' + ', '.join(f'{dtype} {gflops:,.1f}' for dtype, gflops in by_dtype.items())
      for library, by_dtype in summary['matmul_gflops'].items()))
  print('FLOPs/example: torch by FlopCounterMode (convolutions and matmuls), jax by XLA cost '
        'analysis (every op).')
  harness.write_json(FLAGS.json, {
      'device': FLAGS.device, 'device_names': device_names, 'epochs': FLAGS.epochs,
      'rounds': FLAGS.rounds, 'train_examples': FLAGS.train_examples, **summary,
      'every_round': {'runs': every_round, 'libraries': libraries}})


if __name__ == '__main__':
  define_flags()
  app.run(main)
