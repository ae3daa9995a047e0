"""Train-step and inference speed of this app's ImageNet backbones against timm's in PyTorch
and big_vision's ViT, on one machine.

    python -m benchmarks.backbones --json=backbones.json [--task=train|inference] \
      [--models=resnet50,vit_small_patch16_224] [--dtypes=float32,bfloat16] \
      [--pairs=vit_small_patch16_224:float32,resnet50:bfloat16] \
      [--configurations=jax_auto,jax_off,torch_eager,torch_compile,onnxruntime,tflite] \
      [--batch_size=32] [--image_size=224] [--warmup=3] [--steps=5] [--rounds=3] [--device=cpu]

For every model x dtype (or each of --pairs) x configuration a fresh child builds the model and
its optimizer, runs --warmup steps (the first compiles: reported apart) and times --steps steps,
each waited for: the median step gives images/s. Configurations alternate within a model and
dtype, round after round (--rounds), so that a drifting machine (shared cloud cores) hits all
alike; the table shows medians over the rounds, --json keeps every round. --models=toy_resnet (one
basic block a stage, 8-32 features, in both libraries) runs the whole benchmark in seconds.

Configurations:
  jax_auto, jax_off: this app's train step (`training.state.create` and `make_train_step`, as
      `main.py` builds them) for `configs/finetune.py` with the model, `compute_dtype` the
      dtype and `kernels` auto (kernels/ picks the backend's layers) or stock: AdamW, warm-up +
      cosine, label smoothing 0.1, the EMA, 1,000 classes, random uint8 batches.
  torch_eager, torch_compile: `timm.create_model` with the same recipe as timm's train.py runs
      it (AdamW, label smoothing 0.1, `ModelEmaV3`); bfloat16 by `torch.autocast`;
      `torch.compile(model)` compiled cold.
  big_vision (--device=tpu, ViTs): `big_vision/models/vit.py` of a google-research/big_vision
      checkout (--big_vision; never imported by the app or its tests), class-token head,
      matmuls in the dtype, in a plain `jax.jit` AdamW step on its donated state, the same
      schedule and loss on the same batches scaled to [-1, 1]; no EMA, no train metrics.
      Without a checkout its rows are left out, and the run says so.
--task=inference times the class probabilities of a uint8 batch: predict's program (jax_*),
timm's model under `torch.inference_mode()`, the app's ONNX export in ONNX Runtime
(onnxruntime) and its TFLite export in LiteRT (tflite; --batch_size=1 is what a phone runs).
Every child uses every core it may run on and reports its threads. --device=cuda runs JAX's GPU
backend (jax[cuda]) and PyTorch on CUDA; --device=tpu needs jax[tpu].

The first lines and the JSON name the CPU, its ISA features (`harness.machine`), the library
versions and the load; every row carries its load, peak RSS and page faults a step. Every JAX
row carries XLA's FLOP count of the compiled step (`cost_analysis()['flops']`) and its MFU over
the chip's bf16 peak (PEAK_FLOPS) or, on a CPU, a 2048x2048 matmul's FLOP/s in the row's dtype;
a PyTorch row's MFU counts the app's FLOPs of its model and dtype. JAX rows also give the
seconds to create the state and to compile the step, and on an accelerator the chip's kind and
runtime version. --trace_dir writes a profiler trace of each JAX row's timed steps. Without
AVX512-BF16 or AMX, PyTorch's bfloat16 is emulated: measure it alone, at a smaller batch.
"""

import collections
import contextlib
import functools
import json
import os
import resource
import sys
import time

from absl import app
from absl import flags

from benchmarks import harness

FLAGS = flags.FLAGS
CONFIGURATIONS = ('jax_auto', 'jax_off', 'torch_eager', 'torch_compile', 'onnxruntime',
                  'tflite', 'big_vision')
# By --task, then --device. ONNX Runtime and LiteRT run the app's exports: inference only.
DEFAULT_CONFIGURATIONS = {
    'train': {'cpu': CONFIGURATIONS[:4], 'cuda': ('jax_off', 'torch_eager', 'torch_compile'),
              'tpu': ('jax_auto', 'big_vision')},
    'inference': {'cpu': CONFIGURATIONS[:6],
                  'cuda': ('jax_off', 'torch_eager', 'torch_compile'), 'tpu': ('jax_auto',)}}
# big_vision's name of each ViT it can build, by timm's name.
BIG_VISION_VARIANTS = {'vit_tiny_patch16_224': 'Ti/16', 'vit_small_patch16_224': 'S/16',
                       'vit_base_patch16_224': 'B/16', 'vit_large_patch16_224': 'L/16'}
# Dense bfloat16 FLOP/s of one chip, by JAX's device kind: the vendors' published peaks.
PEAK_FLOPS = {'TPU v4': 275e12, 'TPU v5 lite': 197e12, 'TPU v5': 459e12,
              'TPU v6 lite': 918e12, 'NVIDIA H100 80GB HBM3': 989e12, 'NVIDIA H200': 989e12}
# The toy model: timm's ResNet and this app's, one basic block per stage, these widths.
TOY_MODEL, TOY_WIDTHS = 'toy_resnet', (8, 16, 24, 32)
NUM_CLASSES = 1000  # ImageNet's head, as the models are published.
LABEL_SMOOTHING = 0.1  # configs/finetune.py's.


def define_flags() -> None:
  """The command line's flags: defined when run, not at import (tests import the module
  beside other benchmarks, whose flags share names)."""
  flags.DEFINE_string('json', None, 'Where to write the figures (after every row).')
  flags.mark_flag_as_required('json')
  flags.DEFINE_enum('device', 'cpu', ['cpu', 'cuda', 'tpu'], 'Where PyTorch and JAX run.')
  flags.DEFINE_string('big_vision', None, 'The root of a google-research/big_vision checkout, '
                      'for the big_vision rows (ViTs).')
  flags.DEFINE_enum('task', 'train', ['train', 'inference'], 'What is timed: a train step, or '
                    'the class probabilities of a batch (--mode=predict and eval).')
  flags.DEFINE_integer('rounds', 3, 'Rounds of every configuration; figures are medians.',
                       lower_bound=1)
  flags.DEFINE_list('models', ['resnet50', 'vit_small_patch16_224'],
                    "Models, by timm's names (registered in this app under the same names).")
  flags.DEFINE_list('dtypes', ['float32', 'bfloat16'], 'What the models compute in.')
  flags.DEFINE_list('pairs', None, 'model:dtype pairs to run, in order, instead of every '
                    '--models x --dtypes pair (a table of chosen rows within a time limit).')
  flags.DEFINE_list('configurations', None, 'What to run (default: all for --task and '
                    '--device): jax_auto, jax_off, torch_eager, torch_compile, onnxruntime '
                    '(inference), big_vision (train, ViTs).')
  flags.DEFINE_integer('batch_size', 32, 'Images per step.', lower_bound=1)
  flags.DEFINE_integer('image_size', 224, 'Height and width of the images.', lower_bound=16)
  flags.DEFINE_integer('warmup', 3, 'Untimed steps first (the first compiles).', lower_bound=1)
  flags.DEFINE_integer('steps', 5, 'Timed steps; the figure is their median.', lower_bound=1)
  flags.DEFINE_string('trace_dir', None, "Where each JAX row writes a `jax.profiler` trace of its "
                      "timed steps (<trace_dir>/<configuration>_<model>_<dtype>), per-operation "
                      "time for TensorBoard's profile plugin or xprof.")
  # Internal: a child that measures one configuration, in-process.
  flags.DEFINE_enum('child', None, list(CONFIGURATIONS),
                    'Measure this configuration of --models and --dtypes (one each).')


def timed_steps(step, trace: str | None = None) -> dict:
  """Runs `step` (which waits for its work) --warmup + --steps times; the first call's seconds
  (compilation included), every timed step's seconds, and the median timed step's page faults
  (minor: fresh memory the kernel maps and zeroes, which the step's time includes). With
  `trace`, a JAX profiler trace of the timed steps is written there."""
  faults = []

  def counted_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

  times = harness.time_calls(counted_step, FLAGS.warmup)
  tracing = contextlib.nullcontext()
  if trace:
    import jax  # pylint: disable=g-import-not-at-top  (JAX rows only)
    tracing = jax.profiler.trace(trace)
  with tracing:
    times += harness.time_calls(counted_step, FLAGS.steps)
  return {'first_step_seconds': times[0], 'step_seconds': times[FLAGS.warmup:],
          'page_faults_per_step': harness.median(faults[FLAGS.warmup:])}


def register_toy_model() -> None:
  """Registers TOY_MODEL in this process's `models.MODELS` (a measuring child's only)."""
  # pylint: disable=g-import-not-at-top
  from backbones import resnet
  import models
  # pylint: enable=g-import-not-at-top

  @models.MODELS.register(TOY_MODEL)
  class ToyResNet(resnet.ResNet):  # pylint: disable=unused-variable
    block, depths, widths = resnet.BasicBlock, (1, 1, 1, 1), TOY_WIDTHS


def app_run(configuration: str, model: str, dtype: str):
  """configs/finetune.py's run of `model` computing in `dtype`, with the layers of
  `configuration` (jax_auto: the XLA:CPU ones where they apply; jax_off and onnxruntime: the
  stock ones, which the export takes). Starts JAX."""
  # pylint: disable=g-import-not-at-top  (only this child starts JAX; runtime first)
  from core import runtime
  runtime.start()
  from configs import finetune
  from training import run_spec
  # pylint: enable=g-import-not-at-top
  if model == TOY_MODEL:
    register_toy_model()
  config = finetune.get_config()
  config.model = model
  config.compute_dtype = dtype
  config.kernels = 'auto' if configuration == 'jax_auto' else 'stock'
  config.batch_size = FLAGS.batch_size
  return run_spec.resolve(config)


def random_images():
  """A batch of random uint8 images, as the input pipeline hands them to the model (the
  decoded images, resized and cropped)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  return np.random.default_rng(0).integers(
      0, 256, (FLAGS.batch_size, FLAGS.image_size, FLAGS.image_size, 3), np.uint8)


def dataset_info(steps_per_epoch: int = 1):
  from data_sources import base  # pylint: disable=g-import-not-at-top
  return base.DatasetInfo('random', (FLAGS.image_size, FLAGS.image_size, 3), NUM_CLASSES,
                          steps_per_epoch * FLAGS.batch_size, 0)


def measure_jax(configuration: str, model: str, dtype: str) -> dict:
  """Times this app's train step of `model` (configs/finetune.py's recipe) in `dtype`, its
  batch split over every device as training splits it (several on a CPU with
  `XLA_FLAGS=--xla_force_host_platform_device_count=N`)."""
  run = app_run(configuration, model, dtype)
  # pylint: disable=g-import-not-at-top
  from flax import nnx
  import jax
  import numpy as np
  from core import runtime
  from training import parallel
  from training import state as state_lib
  # pylint: enable=g-import-not-at-top
  steps_per_epoch = FLAGS.warmup + FLAGS.steps  # One epoch: the schedule warms up over it.
  info = dataset_info(steps_per_epoch)
  mesh = parallel.create_mesh()
  jax.set_mesh(mesh)  # As training sets it: the state is replicated over the devices.
  start = time.perf_counter()
  state = state_lib.create(run.model, info, run.optimization,
                           run.optimization.learning_rate_schedule(steps_per_epoch),
                           seed=run.seed, ema_decay=run.ema_decay)
  jax.block_until_ready(jax.tree.leaves(state))
  state_seconds = time.perf_counter() - start
  train_step = state_lib.make_train_step(run.loss(info.num_classes), run.input.preprocess)
  labels = np.random.default_rng(1).integers(0, NUM_CLASSES, FLAGS.batch_size, np.int32)
  batch = parallel.shard({'image': random_images(), 'label': labels}, mesh)

  stepper = state_lib.Stepper(train_step, state)  # As the training loop steps it.

  def step():  # Waits for the device: timed_steps times each step whole.
    jax.block_until_ready(stepper(batch))

  # As training does (train._compile): compiled before the first batch, then the compiler's
  # freed memory returned; the first step's seconds include both, and the state's creation.
  start = time.perf_counter()
  compiled = train_step.lower(state, batch).compile()
  compile_seconds = time.perf_counter() - start
  figures = timed_steps(step, trace_path(configuration, model, dtype))
  figures['first_step_seconds'] += state_seconds + compile_seconds
  runtime.release_compiler_memory(compiled)
  return {**figures, **jax_figures(compiled, dtype), 'state_seconds': state_seconds,
          'compile_seconds': compile_seconds, 'ema_decay': run.ema_decay}


def jax_figures(compiled, dtype: str) -> dict:
  """What every JAX row reports of its compiled step and device: XLA's FLOP count of the step,
  the peak FLOP/s its MFU is taken against (PEAK_FLOPS, or on a CPU a matmul's in `dtype`),
  the device's kind and count, the runtime's version and this child's threads."""
  import jax  # pylint: disable=g-import-not-at-top
  device = jax.devices()[0]
  peak = PEAK_FLOPS.get(device.device_kind)
  if peak is None and device.platform == 'cpu':
    peak = harness.matmul_flops_per_sec(dtype)
  return {'flops_per_step': compiled.cost_analysis()['flops'], 'peak_flops': peak,
          'device_name': device.device_kind, 'devices': jax.device_count(),
          'platform_version': device.client.platform_version,
          'threads': len(os.sched_getaffinity(0))}


def measure_big_vision(configuration: str, model: str, dtype: str) -> dict:
  """Times big_vision's ViT of `model` (--big_vision's checkout) computing its matmuls in
  `dtype`, in a plain `jax.jit` AdamW step on the state it donates (the module's docstring)."""
  if model not in BIG_VISION_VARIANTS:
    raise app.UsageError(f'big_vision builds the ViTs {sorted(BIG_VISION_VARIANTS)}, not '
                         f'{model}.')
  sys.path.insert(0, FLAGS.big_vision)
  # pylint: disable=g-import-not-at-top  (only this child imports the peer)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from big_vision.models import vit
  # pylint: enable=g-import-not-at-top
  network = vit.Model(NUM_CLASSES, variant=BIG_VISION_VARIANTS[model], pool_type='tok',
                      dtype_mm=dtype)
  steps = FLAGS.warmup + FLAGS.steps
  optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-4, steps // 2 + 1, steps),
                          weight_decay=0.05)
  images = jnp.asarray(random_images())
  labels = jnp.asarray(np.random.default_rng(1).integers(0, NUM_CLASSES, FLAGS.batch_size))
  scale = lambda images: images.astype(jnp.float32) / 127.5 - 1.0  # big_vision's [-1, 1].

  @jax.jit
  def create():
    params = network.init(jax.random.key(0), scale(images[:1]))['params']
    return params, optimizer.init(params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, images, labels):
    def loss_fn(params):
      logits, _ = network.apply({'params': params}, scale(images), train=True)
      targets = optax.smooth_labels(jax.nn.one_hot(labels, NUM_CLASSES), LABEL_SMOOTHING)
      return optax.softmax_cross_entropy(logits.astype(jnp.float32), targets).mean()
    grads = jax.grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  start = time.perf_counter()
  state = jax.block_until_ready(create())
  state_seconds = time.perf_counter() - start
  start = time.perf_counter()
  compiled = train_step.lower(*state, images, labels).compile()
  compile_seconds = time.perf_counter() - start

  def step():
    nonlocal state
    state = jax.block_until_ready(train_step(*state, images, labels))

  figures = timed_steps(step, trace_path(configuration, model, dtype))
  figures['first_step_seconds'] += state_seconds + compile_seconds
  return {**figures, **jax_figures(compiled, dtype), 'state_seconds': state_seconds,
          'compile_seconds': compile_seconds}


def trace_path(configuration: str, model: str, dtype: str) -> str | None:
  """Where a JAX row's trace goes with --trace_dir."""
  return FLAGS.trace_dir and os.path.join(FLAGS.trace_dir, f'{configuration}_{model}_{dtype}')


def measure_app_inference(configuration: str, model: str, dtype: str) -> dict:
  """Times this app's class probabilities of a batch: --mode=predict's program (jax_*), or the
  app's ONNX or TFLite export of the same model in its runtime (onnxruntime, tflite)."""
  run = app_run(configuration, model, dtype)
  # pylint: disable=g-import-not-at-top
  import tempfile
  import jax
  from flax import nnx
  from modes import export
  from modes import predict
  from training import state as state_lib
  # pylint: enable=g-import-not-at-top
  # Initialised in one program, as training initialises its state: op by op, each initialiser
  # of a new shape would compile alone.
  network = state_lib.run_once(lambda: run.model.build(
      (FLAGS.image_size, FLAGS.image_size, 3), NUM_CLASSES, nnx.Rngs(run.seed)))
  network.eval()
  images = random_images()  # NumPy, as predict hands each batch over.
  if configuration in ('onnxruntime', 'tflite'):
    if dtype != 'float32':
      raise app.UsageError(f'{configuration} runs the float32 export, not {dtype}.')
    export_format = 'onnx' if configuration == 'onnxruntime' else 'tflite'
    exporter = export.format_named(export_format)
    classifier = export.classifier_of(network, dataset_info(), run.input.preprocess)
    with tempfile.TemporaryDirectory() as directory:
      path = os.path.join(directory, exporter.file)
      exporter.write(classifier, path)
      file_bytes = os.path.getsize(path)
      if export_format == 'onnx':
        session = export.require('onnxruntime', 'onnx').InferenceSession(path)
        step = lambda: session.run(['logits'], {'images': images})
      else:
        runner = export.require('ai_edge_litert.interpreter', 'tflite').Interpreter(
            model_path=path).get_signature_runner()
        step = lambda: runner(images=images)
    figures = {'device_name': 'cpu', 'export_bytes': file_bytes}
  else:
    step = lambda: predict.probabilities(network, run.input.preprocess,
                                         images).block_until_ready()
    figures = {'device_name': jax.devices()[0].device_kind}
  return {**timed_steps(step), 'threads': len(os.sched_getaffinity(0)), **figures}


def torch_network(model: str, device):
  """timm's `model` (NUM_CLASSES classes) for --image_size, on `device`, built from seed 0
  with PyTorch's intra-op threads set to every core this process may use."""
  # pylint: disable=g-import-not-at-top  (optional extras)
  import timm
  import torch
  # pylint: enable=g-import-not-at-top
  torch.set_num_threads(len(os.sched_getaffinity(0)))
  torch.manual_seed(0)
  if model == TOY_MODEL:
    network = timm.models.resnet.ResNet(timm.models.resnet.BasicBlock, (1, 1, 1, 1),
                                        channels=TOY_WIDTHS, num_classes=NUM_CLASSES)
  else:
    network = timm.create_model(model, num_classes=NUM_CLASSES)
  if getattr(network, 'patch_embed', None) and network.patch_embed.img_size != (
      FLAGS.image_size,) * 2:  # A ViT's position embeddings are for one size: built for ours.
    network = timm.create_model(model, num_classes=NUM_CLASSES, img_size=FLAGS.image_size)
  return network.to(device)


def synchronize(device) -> None:
  """Waits for the work queued on PyTorch's `device` (on a CPU, done when a call returns)."""
  import torch  # pylint: disable=g-import-not-at-top  (optional extras)
  if device.type == 'cuda':
    torch.cuda.synchronize(device)


def torch_threads_and_device(device) -> dict:
  """What a PyTorch child reports beside its times: its threads and its device's name."""
  import torch  # pylint: disable=g-import-not-at-top  (optional extras)
  return {'threads': torch.get_num_threads(),
          'device_name': (torch.cuda.get_device_name(device) if device.type == 'cuda'
                          else 'cpu')}


def measure_torch(configuration: str, model: str, dtype: str) -> dict:
  """Times a train step of timm's `model` in PyTorch, as `configuration` runs it."""
  # pylint: disable=g-import-not-at-top  (optional extras; only this child imports them)
  import timm.utils
  import torch
  from torch.nn import functional as F

  # pylint: enable=g-import-not-at-top
  device = torch.device(FLAGS.device)
  network = torch_network(model, device).train()
  optimizer = torch.optim.AdamW(network.parameters(), lr=3e-4, weight_decay=0.05)
  ema = timm.utils.ModelEmaV3(network, decay=0.99)
  forward = torch.compile(network) if configuration == 'torch_compile' else network
  images = torch.rand(FLAGS.batch_size, 3, FLAGS.image_size, FLAGS.image_size, device=device)
  labels = torch.randint(0, NUM_CLASSES, (FLAGS.batch_size,), device=device)

  def step():  # Waits for the device: timed_steps times each step whole.
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == 'bfloat16'):
      loss = F.cross_entropy(forward(images), labels, label_smoothing=LABEL_SMOOTHING)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    ema.update(network)
    synchronize(device)

  return {**timed_steps(step), **torch_threads_and_device(device)}


def measure_torch_inference(configuration: str, model: str, dtype: str) -> dict:
  """Times timm's `model`'s class probabilities of a uint8 batch under
  `torch.inference_mode()`: scaled to [0, 1] and normalised with the model's statistics, as
  timm's transforms do, then the model and the softmax (compiled whole for torch_compile)."""
  # pylint: disable=g-import-not-at-top  (optional extras; only this child imports them)
  import timm.data
  import torch

  # pylint: enable=g-import-not-at-top
  device = torch.device(FLAGS.device)
  network = torch_network(model, device).eval()
  data = timm.data.resolve_data_config({}, model=network)
  mean = torch.tensor(data['mean'], device=device).view(1, 3, 1, 1)
  std = torch.tensor(data['std'], device=device).view(1, 3, 1, 1)

  def probabilities(images):
    inputs = (images.permute(0, 3, 1, 2).float() / 255 - mean) / std
    return network(inputs).softmax(dim=-1)

  forward = torch.compile(probabilities) if configuration == 'torch_compile' else probabilities
  images = torch.from_numpy(random_images()).to(device)

  def step():
    with (torch.inference_mode(),
          torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == 'bfloat16')):
      forward(images)
    synchronize(device)

  return {**timed_steps(step), **torch_threads_and_device(device)}


# By --task, then the library a configuration runs in (the part of its name before '_').
MEASURES = {'train': {'jax': measure_jax, 'torch': measure_torch, 'big': measure_big_vision},
            'inference': {'jax': measure_app_inference, 'onnxruntime': measure_app_inference,
                          'tflite': measure_app_inference, 'torch': measure_torch_inference}}


def run_configuration(configuration: str, model: str, dtype: str) -> dict:
  """Measures one configuration in a fresh child; its figures, with the load it started at."""
  load = os.getloadavg()[0]  # 1 minute, as `uptime` prints it.
  figures, child = harness.json_child(
      [sys.executable, '-m', 'benchmarks.backbones', f'--child={configuration}',
       f'--task={FLAGS.task}', f'--models={model}', f'--dtypes={dtype}',
       f'--device={FLAGS.device}', f'--big_vision={FLAGS.big_vision or ""}',
       f'--batch_size={FLAGS.batch_size}', f'--image_size={FLAGS.image_size}',
       f'--warmup={FLAGS.warmup}', f'--steps={FLAGS.steps}',
       f'--trace_dir={FLAGS.trace_dir or ""}'],
      None if configuration.startswith('torch') else harness.jax_child_env(FLAGS.device))
  median_step = harness.median(figures['step_seconds'])
  return {**figures, 'median_step_seconds': median_step,
          'images_per_sec': FLAGS.batch_size / median_step, 'process_seconds': child.seconds,
          'load_1min': load, 'mfu': mfu(figures.get('flops_per_step'),
                                        figures.get('peak_flops'), median_step)}


def mfu(flops_per_step: float | None, peak_flops: float | None,
        step_seconds: float) -> float | None:
  """The step's FLOP/s over the peak, or None without both."""
  if not flops_per_step or not peak_flops:
    return None
  return flops_per_step / step_seconds / peak_flops


def summarize(every_round: dict[tuple[str, str, str], list[dict]]) -> list[dict]:
  """A row per (model, dtype, configuration): medians over the rounds, images/s over the best
  PyTorch configuration's of the same model and dtype, and MFU (a PyTorch row's with the FLOPs
  of the app's step of its model and dtype)."""
  rows = []
  for (model, dtype, configuration), runs in every_round.items():
    optional = lambda key: harness.median([run[key] for run in runs]) if key in runs[0] else None
    rows.append({'model': model, 'dtype': dtype, 'configuration': configuration,
                 **{key: harness.median([run[key] for run in runs])
                    for key in ('images_per_sec', 'median_step_seconds', 'first_step_seconds',
                                'load_1min', 'peak_rss_mb', 'page_faults_per_step')},
                 # JAX's alone (an export's file size, its runtime's); None for the others.
                 **{key: optional(key) for key in ('flops_per_step', 'peak_flops',
                                                   'state_seconds', 'compile_seconds',
                                                   'export_bytes')},
                 'threads': runs[0]['threads'], 'device_name': runs[0]['device_name'],
                 'devices': runs[0].get('devices'),
                 'platform_version': runs[0].get('platform_version')})
  for row in rows:
    same = [other for other in rows
            if (other['model'], other['dtype']) == (row['model'], row['dtype'])]
    torch_rates = [other['images_per_sec'] for other in same
                   if other['configuration'].startswith('torch')]
    row['vs_best_torch'] = row['images_per_sec'] / max(torch_rates) if torch_rates else None
    app_row = next((other for other in same if other['configuration'].startswith('jax')
                    and other['flops_per_step']), None)
    if row['flops_per_step'] is None and app_row is not None:
      row['flops_per_step'], row['peak_flops'] = app_row['flops_per_step'], app_row['peak_flops']
    row['mfu'] = mfu(row['flops_per_step'], row['peak_flops'], row['median_step_seconds'])
  return rows


def markdown_table(rows: list[dict]) -> str:
  """The table of `rows` (summarize's)."""
  return harness.markdown_table(
      ['model', 'dtype', 'configuration', 'images/s', 'MFU', 'median step (s)',
       'first step, compile included (s)', 'vs best PyTorch', 'peak RSS (MB)',
       'page faults a step', 'threads', 'load (1 min)'],
      [[row['model'], row['dtype'], row['configuration'], f'{row["images_per_sec"]:,.2f}',
        f'{row["mfu"]:.1%}' if row.get('mfu') is not None else '',
        f'{row["median_step_seconds"]:.3f}', f'{row["first_step_seconds"]:.1f}',
        f'{row["vs_best_torch"]:.2f}x' if row['vs_best_torch'] is not None else '',
        f'{row["peak_rss_mb"]:,.0f}', f'{row["page_faults_per_step"]:,.0f}', row['threads'],
        f'{row["load_1min"]:.2f}']
       for row in rows], align='lllrrrrrrrrr')


def selected_configurations() -> list[str]:
  known = [name for name in CONFIGURATIONS if name in MEASURES[FLAGS.task]
           or name.split('_')[0] in MEASURES[FLAGS.task]]
  names = list(FLAGS.configurations or DEFAULT_CONFIGURATIONS[FLAGS.task][FLAGS.device])
  unknown = [name for name in names if name not in known]
  if unknown:
    raise app.UsageError(f'--configurations {unknown} do not run --task={FLAGS.task} on '
                         f'--device={FLAGS.device}: choose from {list(known)}.')
  if 'big_vision' in names and not os.path.isfile(os.path.join(
      FLAGS.big_vision or '', 'big_vision', 'models', 'vit.py')):
    print(f'No big_vision rows: --big_vision={FLAGS.big_vision or ""} is not a checkout of '
          'google-research/big_vision (git clone https://github.com/google-research/big_vision '
          'and pass its root).', flush=True)
    names.remove('big_vision')
  return names


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if FLAGS.child:
    (model,), (dtype,) = FLAGS.models, FLAGS.dtypes
    measure = MEASURES[FLAGS.task][FLAGS.child.split('_')[0]]
    figures = measure(FLAGS.child, model, dtype)
    # Peak resident memory of the whole child (model, optimizer, activations, compiler), MB.
    figures['peak_rss_mb'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(FLAGS.json, 'w', encoding='utf-8') as file:
      json.dump(figures, file)
    return

  configurations = selected_configurations()
  started_load = os.getloadavg()
  header = [harness.machine_line(harness.machine()),
            f'Load average at start (1, 5, 15 min): {", ".join(f"{x:.2f}" for x in started_load)}; '
            f'{FLAGS.task}, batch {FLAGS.batch_size}, {FLAGS.image_size} px, {FLAGS.warmup} '
            f'warm-up + {FLAGS.steps} timed steps, {FLAGS.rounds} round(s), on {FLAGS.device}']
  print('\n'.join(header), flush=True)
  every_round = collections.defaultdict(list)
  for round_index in range(1, FLAGS.rounds + 1):
    for model, dtype in model_dtype_pairs(FLAGS.models, FLAGS.dtypes, FLAGS.pairs):
      for configuration in configurations:
        if configuration == 'big_vision' and model not in BIG_VISION_VARIANTS:
          continue  # big_vision's rows are ViTs'.
        run = run_configuration(configuration, model, dtype)
        every_round[model, dtype, configuration].append(run)
        print(f'round {round_index} {model} {dtype} {configuration}: '
              f'{run["images_per_sec"]:.2f} images/s (steps {run["step_seconds"]}), first '
              f'step {run["first_step_seconds"]:.1f} s, load {run["load_1min"]:.2f}',
              flush=True)
        # The figures so far: a run cut short (a time limit) keeps every finished row.
        rows = write_report(started_load, every_round)
  print(f'\nLoad average at end (1, 5, 15 min): '
        f'{", ".join(f"{x:.2f}" for x in os.getloadavg())}\n\n{markdown_table(rows)}')


def model_dtype_pairs(models: list[str], dtypes: list[str],
                      pairs: list[str] | None) -> list[tuple[str, str]]:
  """The (model, dtype) of each row to run: `pairs` ('model:dtype') where given, else every
  model with every dtype."""
  if not pairs:
    return [(model, dtype) for model in models for dtype in dtypes]
  chosen = [tuple(pair.split(':')) for pair in pairs]
  if any(len(pair) != 2 for pair in chosen):
    raise app.UsageError(f'--pairs takes model:dtype items, not {",".join(pairs)}.')
  return chosen


def write_report(started_load: tuple[float, ...],
                 every_round: dict[tuple[str, str, str], list[dict]]) -> list[dict]:
  """Writes the JSON report of the runs so far to --json; returns its rows (summarize's)."""
  rows = summarize(every_round)
  harness.write_json(FLAGS.json, {
      'device': FLAGS.device, 'task': FLAGS.task, 'batch_size': FLAGS.batch_size,
      'image_size': FLAGS.image_size,
      'warmup': FLAGS.warmup, 'steps': FLAGS.steps, 'rounds': FLAGS.rounds,
      'load_at_start': started_load, 'load_at_end': os.getloadavg(), 'rows': rows,
      'every_round': [{'model': model, 'dtype': dtype, 'configuration': configuration,
                       'runs': runs}
                      for (model, dtype, configuration), runs in every_round.items()]})
  return rows


if __name__ == '__main__':
  define_flags()
  app.run(main)
