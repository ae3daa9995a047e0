"""The training state, checkpointed whole, and the compiled train and eval steps.

`TrainState` holds the model, its optimizer, the moving average of its weights (`nnx.EMA`,
when config.ema_decay is set) and the sums behind the train metrics. The train step updates it
in place inside one XLA program; the eval step folds a batch into the evaluators' states. Both
take batches as they leave the host (uint8 images, mostly) and run the preprocessing's scale
stage (`Preprocessing.scale`) inside their program.
"""

import contextlib
import functools
from collections.abc import Callable

from flax import nnx
import jax
import jax.numpy as jnp
import optax

from data_sources import base
import evaluators as evaluators_lib
import models
import preprocessing
from training import losses
from training import optimizers
from training import parallel

Batch = dict[str, jax.Array]
_MODE_ATTRIBUTES = ('deterministic', 'use_running_average')  # What train() and eval() set.


class MetricSums(nnx.Module):
  """Sums over the examples trained on since the last reset: cross-entropy and correct ones.

  Both are taken against what each image shows: its label, or for a mixed image (Mixup,
  CutMix) its soft target and that target's larger class. Against the label alone, a run with
  mixup_alpha=0.1 read 0.49 train accuracy (half its images are mostly their partner), which
  looks broken.
  """

  def __init__(self):
    self.loss = nnx.Variable(jnp.zeros((), jnp.float32))
    self.correct = nnx.Variable(jnp.zeros((), jnp.int32))
    self.count = nnx.Variable(jnp.zeros((), jnp.int32))

  def add(self, logits: jax.Array, targets: jax.Array) -> None:
    """Adds a batch: `targets` are integer labels (batch,) or soft targets (batch, classes)."""
    targets = losses.soft_targets(targets, logits.shape[-1])
    self.loss[...] += optax.softmax_cross_entropy(logits, targets).sum()
    self.correct[...] += (logits.argmax(axis=-1) == targets.argmax(axis=-1)).sum(dtype=jnp.int32)
    self.count[...] += targets.shape[0]

  def reset(self) -> None:
    for variable in (self.loss, self.correct, self.count):
      variable[...] = jnp.zeros_like(variable[...])

  def results(self, prefix: str = 'train') -> dict[str, float]:
    """{'train/loss', 'train/accuracy'} on the host: means over the examples summed."""
    count = max(int(self.count[...]), 1)
    return {f'{prefix}/loss': float(self.loss[...]) / count,
            f'{prefix}/accuracy': float(self.correct[...]) / count}


class TrainState(nnx.Module):
  """Everything a training run resumes from, but the position in the data."""

  def __init__(self, model: nnx.Module, optimizer: nnx.Optimizer, ema: nnx.EMA | None):
    self.model = model
    self.optimizer = optimizer
    self.ema = ema
    self.window = MetricSums()  # Since the last write of the train metrics.
    self.epoch = MetricSums()  # Since the epoch began.

  def eval_model(self) -> nnx.Module:
    """The model to evaluate: with the moving-average weights when there are some."""
    return self.model if self.ema is None else self.ema.apply_to(self.model)


def create_ema(decay: float, model: nnx.Module) -> nnx.EMA | None:
  """The moving average of `model`'s weights if `decay` > 0 (config.ema_decay), else None.

  BatchNorm's running statistics are averaged too: statistics of the current weights do not
  fit the averaged ones (eval accuracy 0.12 after 2 MNIST epochs with decay 0.999, in a run
  that trained at 0.98).
  """
  if not decay:
    return None
  return nnx.EMA(model, decay, only=nnx.Any(nnx.Param, nnx.BatchStat))


def update_ema(ema: nnx.EMA, model: nnx.Module, step: jax.Array) -> None:
  """Moves `ema` towards `model` after update `step` (1, 2, ...), with a decay that warms up.

  The decay is min(ema.decay, (1 + step) / (10 + step)), as TensorFlow's
  ExponentialMovingAverage does with num_updates (and timm's ModelEmaV3 with warm-up): early
  on, the average follows the weights instead of holding on to their random start (configs/
  best.py evaluated the averaged weights at 77.7% after epoch 1 while training at 89-99%).
  Written here because `nnx.EMA.update` takes a fixed decay. The rule is the same, taken as a
  step towards the weights, average + (1 - decay) (weights - average), as timm's `lerp_`: the
  average of a weight that does not move (frozen) stays exactly that weight, where decay *
  average + (1 - decay) * weight rounds it (a fifth of a frozen BatchNorm's statistics moved).
  """
  decay = jnp.minimum(ema.decay, (1.0 + step) / (10.0 + step))

  def step_towards(average: nnx.Variable, new: nnx.Variable) -> None:
    average.set_value(average[...] + (1 - decay) * (new[...] - average[...]))

  jax.tree.map(step_towards, ema.params, nnx.state(model, ema.filter),
               is_leaf=lambda x: isinstance(x, nnx.Variable))


class Planned:
  """A training state traced but not yet built: its structure and placement (`abstract`: shapes,
  dtypes and shardings, nothing computed) and the program that builds it (`build`).

  Both share one structure, static parts included (the optimizer's transform), so that a step
  compiled for `abstract` (while `build` runs, or before a checkpoint is restored into it) is
  the step the built state calls: an executable is reused only for the same structure.
  """

  def __init__(self, create_state: Callable[[], 'TrainState'], optimization):
    graphdefs = []

    def create_arrays() -> nnx.State:
      graphdef, arrays = nnx.split(create_state())
      graphdefs.append(graphdef)
      return arrays

    shapes = jax.eval_shape(create_arrays)
    self._graphdef = graphdefs[0]
    self._optimization = optimization
    shardings = jax.tree.map(lambda leaf: _sharding(leaf.shape), shapes)
    self._shardings = shardings
    self._build = jax.jit(create_arrays, out_shardings=shardings)
    self._create_arrays = create_arrays
    self.abstract = self._merged(jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        shapes, shardings))

  def build(self, on_host: bool | None = None) -> 'TrainState':
    """The state itself, its arrays computed by one program and placed by `_sharding`.

    On an accelerator in a single process (or with `on_host`), the program runs on the host's
    CPU and its arrays are copied over: XLA:TPU took 22-38 s to compile a ViT's initialisation
    (docs/accelerators.md), XLA:CPU compiles it several times faster. The values are the same on
    either (threefry's random bits; tests/test_parallel.py).
    """
    host = _host_cpu()
    if on_host is None:
      on_host = jax.default_backend() != 'cpu' and jax.process_count() == 1
    if not on_host or host is None:
      level = _CPU_STATE_OPTIMIZATION_LEVEL if jax.default_backend() == 'cpu' else 0
      return self._merged(run_once(self._build, optimization_level=level))
    # Under a mesh of the host alone: the mesh in force would place the program over the
    # accelerators, whatever the default device.
    with jax.set_mesh(jax.sharding.Mesh([host], ('host',))):
      arrays = run_once(jax.jit(self._create_arrays),
                        optimization_level=_CPU_STATE_OPTIMIZATION_LEVEL)
    return self._merged(jax.device_put(arrays, self._shardings))

  def _merged(self, arrays: nnx.State) -> 'TrainState':
    state = nnx.merge(self._graphdef, arrays)
    for path, module in nnx.iter_modules(state.model):
      # A frozen BatchNorm normalises with its statistics as loaded, in training too.
      if (isinstance(module, nnx.BatchNorm)
          and self._optimization.frozen('.'.join(map(str, path)))):
        module.use_running_average = True
    return state


def plan(model: models.ModelSpec, info: base.DatasetInfo,
         optimization: optimizers.Optimization, schedule: optax.Schedule, *, seed: int,
         ema_decay: float = 0.0) -> Planned:
  """The initial training state of `model` for the data of `info`, updated by `optimization`
  along `schedule` (`Planned`: its structure now, its arrays built by one XLA program). Its
  arrays are placed over the mesh in force by `parallel.state_sharding` (replicated, or split
  for FSDP).

  Run eagerly, XLA compiles every initialiser op on its own at its full optimisation level; as
  one program, which runs once, at the lowest level, it compiles and runs several times faster.
  """
  def create_state() -> TrainState:
    built = model.build(info.image_shape, info.num_classes, nnx.Rngs(seed))
    transform = optimization.transform(schedule, nnx.state(built, nnx.Param))
    return TrainState(built, nnx.Optimizer(built, transform, wrt=nnx.Param),
                      create_ema(ema_decay, built))

  return Planned(create_state, optimization)


def create(model: models.ModelSpec, info: base.DatasetInfo,
           optimization: optimizers.Optimization, schedule: optax.Schedule, *, seed: int,
           ema_decay: float = 0.0, abstract: bool = False) -> TrainState:
  """`plan(...)`'s state, built; with `abstract`, its structure only, for a checkpoint to be
  restored into."""
  planned = plan(model, info, optimization, schedule, seed=seed, ema_decay=ema_decay)
  return planned.abstract if abstract else planned.build()


# The training state's program draws every parameter (threefry bits, truncated normals) and
# runs once: unoptimised, XLA:CPU runs each of those elementwise operations as its own pass over
# memory, so its run grows with the model; its first optimisation level fuses them, for a
# little more compile: a net gain for large models (a ViT-B/16 and up), about even for small.
_CPU_STATE_OPTIMIZATION_LEVEL = 1


def run_once(function: Callable, *args, optimization_level: int = 0):
  """`function(*args)` (an `nnx.jit` or `jax.jit` function, or a plain one) as one program
  compiled at XLA's `optimization_level` (default the lowest), for a program that runs once
  (an initialisation): optimising it fully would cost more than it saves."""
  if not hasattr(function, 'lower'):
    function = nnx.jit(function)
  return function.lower(*args).compile(
      {'xla_backend_optimization_level': optimization_level})(*args)


def _host_cpu() -> jax.Device | None:
  """This process's first CPU device; None where $JAX_PLATFORMS leaves the CPU out."""
  try:
    return jax.local_devices(backend='cpu')[0]
  except RuntimeError:
    return None


def _sharding(shape: tuple[int, ...]) -> jax.sharding.Sharding:
  """Where `create` places a state array of `shape`: by `parallel.state_sharding` over the mesh
  in force (`jax.set_mesh`), else on the default device."""
  mesh = jax.sharding.get_mesh()
  if mesh.empty:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return parallel.state_sharding(mesh, shape)


@contextlib.contextmanager
def eval_mode(model: nnx.Module):
  """`model` in eval mode (running BatchNorm averages, no dropout) inside the block; after it,
  every module's mode as it was (a frozen BatchNorm stays in eval mode)."""
  modes = [(module, {name: getattr(module, name) for name in _MODE_ATTRIBUTES
                     if hasattr(module, name)})
           for _, module in nnx.iter_modules(model)]
  model.eval()
  try:
    yield model
  finally:
    for module, attributes in modes:
      for name, value in attributes.items():
        setattr(module, name, value)


class TrainStep:
  """One compiled update of a `TrainState` on one batch. `step(state, batch)` updates `state` in
  place; the training loop steps a `Stepper` instead, which keeps the state's arrays between
  steps. Both run one program per structure of state (`lower` compiles it ahead).

  The program is a `jax.jit` function of the state's arrays as one flat list, not an `nnx.jit`
  one: `nnx.jit`, even through `nnx.cached_partial`, walks and updates the graph of modules and
  variables on the host at every call, and a chip whose step takes a fraction of a millisecond
  (MNIST's CNN) idled between steps (docs/accelerators.md).
  """

  def __init__(self, update: Callable[[TrainState, Batch], None]):
    self.update = update  # The update itself, in place, uncompiled.
    self._programs = {}  # By the state's structure.

  def program(self, state: TrainState) -> tuple[Callable, list]:
    """The compiled step for `state`'s structure (an abstract state will do): leaves, batch ->
    (new leaves, the step count after the update); and `state`'s arrays as those leaves."""
    graphdef, arrays = nnx.split(state)
    leaves, treedef = jax.tree.flatten(arrays)
    key = graphdef, treedef
    if key not in self._programs:
      def step(leaves: list[jax.Array], batch: Batch) -> tuple[list[jax.Array], jax.Array]:
        state = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        self.update(state, batch)
        return jax.tree.leaves(nnx.state(state)), state.optimizer.step[...]

      self._programs[key] = jax.jit(step, donate_argnums=0)
    return self._programs[key], leaves

  def lower(self, state: TrainState, batch: Batch) -> jax.stages.Lowered:
    program, leaves = self.program(state)
    return program.lower(leaves, batch)

  def __call__(self, state: TrainState, batch: Batch) -> None:
    stepper = Stepper(self, state)
    stepper(batch)
    stepper.sync()


class Stepper:
  """Steps `state` by `train_step`, keeping its arrays between steps; `sync()` writes them into
  the state's modules (do so before reading the state; a change made to it after `sync()` is
  what the next step starts from)."""

  def __init__(self, train_step: TrainStep, state: TrainState):
    self._train_step, self._state = train_step, state
    self._program = self._leaves = None

  def __call__(self, batch: Batch) -> jax.Array:
    """Dispatches one step; returns the step count after it, an array ready when the step is."""
    if self._leaves is None:
      self._program, self._leaves = self._train_step.program(self._state)
    self._leaves, step = self._program(self._leaves, batch)
    return step

  def sync(self) -> TrainState:
    """The state, its modules holding the arrays of the last step."""
    if self._leaves is not None:
      structure = jax.tree.structure(nnx.state(self._state))
      nnx.update(self._state, jax.tree.unflatten(structure, self._leaves))
      self._leaves = None
    return self._state


def make_train_step(loss: losses.Loss, preprocess: preprocessing.Preprocessing,
                    features: bool = False) -> TrainStep:
  """The compiled train step for `loss`: one update of the state on one batch, its images
  scaled by `preprocess` first; with `features`, on a batch of pooled features instead of
  images ('features': a linear probe's cache), through the classifier alone (`model.logits`)."""

  def update(state: TrainState, batch: Batch) -> None:
    targets = batch.get('target', batch['label'])  # Soft targets of mixed batches.
    if features:
      forward = lambda model: model.logits(batch['features'])
    else:
      images = preprocess.scale(batch['image'])
      forward = lambda model: model(images)

    def loss_fn(model):
      logits = forward(model).astype(jnp.float32)  # The loss in float32, whatever the model
      return loss(logits, targets).mean(), logits  # computes in.

    (_, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(state.model)
    state.optimizer.update(state.model, grads)
    if state.ema is not None:
      update_ema(state.ema, state.model, state.optimizer.step[...])
    state.window.add(logits, targets)
    state.epoch.add(logits, targets)

  return TrainStep(update)


def make_eval_step(evaluators: list[evaluators_lib.Evaluator],
                   preprocess: preprocessing.Preprocessing, features: bool = False):
  """The compiled eval step: (model, states, batch) -> the evaluators' states after the batch,
  its images scaled by `preprocess` first (the evaluators see them scaled); with `features`,
  the batch gains the model's pooled features (`model.pre_logits`) as 'features'."""

  @nnx.jit
  def eval_step(model: nnx.Module, states: list, batch: Batch) -> list:
    batch = {**batch, 'image': preprocess.scale(batch['image'])}
    if features:  # XLA computes the backbone once for both: the same ops on the same input.
      batch['features'] = model.pre_logits(batch['image']).astype(jnp.float32)
    logits = model(batch['image']).astype(jnp.float32)
    return [evaluator.update(state, logits, batch)
            for evaluator, state in zip(evaluators, states)]

  return eval_step


@functools.partial(nnx.jit, static_argnums=1)
def features_of(model: nnx.Module, preprocess: preprocessing.Preprocessing,
                images: jax.Array) -> jax.Array:
  """The pooled features (`model.pre_logits`) of a batch of images, scaled by `preprocess` in
  the same program: the embeddings of --mode=embed and of the evaluators of features."""
  return model.pre_logits(preprocess.scale(images)).astype(jnp.float32)


def scaled(batches, preprocess: preprocessing.Preprocessing):
  """`batches` (placed on the devices) with their images scaled by `preprocess` there, for the
  few that go to the model outside the train and eval steps (precise BatchNorm statistics,
  temperature fitting)."""
  return (_scaled_batch(batch, preprocess) for batch in batches)


@functools.partial(jax.jit, static_argnums=1)  # Compiled once per preprocessing, not per call.
def _scaled_batch(batch: Batch, preprocess: preprocessing.Preprocessing) -> Batch:
  return {**batch, 'image': preprocess.scale(batch['image'])}


@nnx.jit
def _batch_statistics(probe: nnx.Module, images: jax.Array) -> dict:
  """The BatchNorm statistics of one batch (`probe` normalises it with momentum 0), as plain
  arrays: an `nnx.State` returned holds the probe's own Variables, which the next batch
  overwrites (every batch's would read as the last's)."""
  probe(images)
  return nnx.to_pure_dict(nnx.state(probe, nnx.BatchStat))


def recompute_batch_statistics(model: nnx.Module, batches) -> None:
  """Sets the statistics of `model`'s BatchNorms to their mean over `batches` ("precise BN", Wu
  and Johnson 2021): each batch normalised with its own statistics, as in training, without
  dropout or stochastic depth, by the current weights. A frozen BatchNorm keeps its statistics
  as they are.

  The running averages that training keeps (momentum 0.99) lag the weights: they start at mean
  0 and variance 1, and still weigh that start by 0.55 after 60 steps; and when a layer's input
  drifts (bfloat16's rounded gradients move the biases before BatchNorm), they trail it:
  `tests/test_train_options.py` shows the accuracy they cost MNIST in bfloat16.
  """
  probe = nnx.clone(model)
  # Every random layer off (nnx.Dropout and the backbones' DropPath alike): statistics taken
  # with branches dropped are noisy from epoch to epoch and wider than eval's.
  probe.set_attributes(deterministic=True, raise_if_not_found=False)
  trained = set()  # The paths of the BatchNorms not frozen, whose statistics are recomputed.
  for path, module in nnx.iter_modules(probe):  # `model` is in training mode.
    if isinstance(module, nnx.BatchNorm) and not module.use_running_average:  # Not frozen.
      module.momentum = 0.0
      trained.add(path)
  if not trained:
    return  # Every BatchNorm frozen: each keeps its statistics, no pass over `batches`.
  statistics = [_batch_statistics(probe, batch['image']) for batch in batches]
  if statistics:
    mean = nnx.state(probe, nnx.BatchStat)
    nnx.replace_by_pure_dict(mean, _mean(statistics))
    # A frozen BatchNorm's statistics are left out, not written back as the mean of their
    # copies: that mean rounds them (the last bit of a quarter of them over 5 batches).
    nnx.update(model, mean.filter(lambda path, _: path[:-1] in trained))


@jax.jit
def _mean(trees: list) -> object:
  """The mean of `trees` (of one structure), leaf by leaf, as one program (op by op, each sum
  and division would compile and run its own)."""
  return jax.tree.map(lambda *values: sum(values) / len(values), *trees)


def has_batch_norm(model: nnx.Module) -> bool:
  return any(isinstance(module, nnx.BatchNorm) for _, module in nnx.iter_modules(model))


def all_finite(state: TrainState) -> bool:
  """Whether every float in `state` is finite (a NaN/Inf anywhere would be checkpointed)."""
  leaves = [leaf for leaf in jax.tree.leaves(nnx.state(state))
            if jnp.issubdtype(leaf.dtype, jnp.inexact)]
  return bool(_all_finite(leaves))


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> jax.Array:
  return jnp.all(jnp.array([jnp.isfinite(leaf).all() for leaf in leaves]))

