"""Optax optimizers and learning-rate schedules, chosen by name in the config.

An optimizer is registered with `@OPTIMIZERS.register(name)`: a factory that takes the learning
rate (a schedule) and its options (from `config.optimizer_options.<name>`) and returns an
`optax.GradientTransformation`. Any other optax optimizer whose first argument is the learning
rate (`lamb`, `lion`, `adafactor`, `rmsprop`, ...) works by its optax name, its keyword
arguments from the same section. A schedule is registered with `@SCHEDULES.register(name)`: a
factory that takes the peak learning rate, the number of optimizer updates it spans and its
options (`config.schedule_options.<name>`). Any schedule can start with a linear warm-up of
`config.warmup_epochs`.

Around the optimizer (`Optimization`, resolved from the config by `training/run_spec.py`):
gradient clipping (`grad_clip_norm`), frozen parameters and learning-rate multipliers by
parameter path (`freeze`, `lr_multipliers`, and layer-wise decay `layer_decay` for models that
declare their `models.LayerGroups`, through `optax.multi_transform`), skipping non-finite updates
(`nonfinite='skip'`) and gradient accumulation (`grad_accum_steps`).
"""

from collections.abc import Callable, Iterable
import dataclasses
import functools
import inspect
import re

import jax
import optax

from core import registry
import models


def _optax_optimizer(name: str) -> Callable | None:
  """optax.<name> when it is an optimizer taking the learning rate first."""
  factory = getattr(optax, name, None)
  if not callable(factory) or inspect.isclass(factory):
    return None
  try:
    parameters = list(inspect.signature(factory).parameters)
  except (TypeError, ValueError):
    return None
  return factory if parameters[:1] == ['learning_rate'] else None


OPTIMIZERS = registry.Registry('optimizer', key='optimizer', app_args=1,  # (learning_rate)
                               fallback=_optax_optimizer)
# (learning_rate, num_updates)
SCHEDULES = registry.Registry('schedule', key='schedule', app_args=2)
NONFINITE = ('halt', 'skip')
# With config.nonfinite='skip': updates with NaN/Inf gradients skipped in a row before the
# optimizer applies them; the non-finite state is then refused at the next save.
MAX_SKIPPED_UPDATES = 10


def _check_momentum(momentum: float) -> None:
  if not 0 <= momentum < 1:
    raise ValueError(f'momentum={momentum!r} must be in [0, 1) (0 = plain SGD)')


def decay_mask(params) -> object:
  """True for the weights that weight decay applies to: kernels (2 or more dimensions), not
  biases or normalisation scales, as in most recipes (timm, big_vision)."""
  return jax.tree.map(lambda param: param.ndim > 1, params)


@OPTIMIZERS.register('sgd')
def sgd(learning_rate: optax.Schedule, *, momentum: float = 0.9,
        nesterov: bool = False) -> optax.GradientTransformation:
  """SGD with (heavy-ball or Nesterov) momentum; momentum 0 is plain SGD."""
  _check_momentum(momentum)
  return optax.sgd(learning_rate, momentum=momentum or None, nesterov=nesterov)


@OPTIMIZERS.register('sgd_l2')
def sgd_l2(learning_rate: optax.Schedule, *, momentum: float = 0.9,
           weight_decay: float = 1e-4) -> optax.GradientTransformation:
  """SGD with L2 weight decay of the kernels added to the gradients, as the classic ResNet
  recipes apply it (torch.optim.SGD's weight_decay, but not on biases and scales)."""
  _check_momentum(momentum)
  return optax.chain(optax.add_decayed_weights(weight_decay, mask=decay_mask),
                     optax.sgd(learning_rate, momentum=momentum or None))


@OPTIMIZERS.register('adam')
def adam(learning_rate: optax.Schedule, *, b1: float = 0.9, b2: float = 0.999,
         mu_dtype: str = 'float32') -> optax.GradientTransformation:
  """Adam; `mu_dtype` 'bfloat16' keeps the first moment in bfloat16 (a quarter of the
  optimizer's memory saved: for a model that barely fits, such as ViT-L/16 on 16 GB)."""
  return optax.adam(learning_rate, b1=b1, b2=b2, mu_dtype=mu_dtype)


@OPTIMIZERS.register('adamw')
def adamw(learning_rate: optax.Schedule, *, weight_decay: float = 1e-4, b1: float = 0.9,
          b2: float = 0.999, mu_dtype: str = 'float32') -> optax.GradientTransformation:
  """Adam with decoupled weight decay of the kernels (`mu_dtype`: as adam's)."""
  return optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask,
                     mu_dtype=mu_dtype)


@SCHEDULES.register('constant')
def constant(learning_rate: float, num_updates: int) -> optax.Schedule:
  del num_updates  # A constant rate needs none.
  return optax.constant_schedule(learning_rate)


@SCHEDULES.register('cosine')
def cosine(learning_rate: float, num_updates: int) -> optax.Schedule:
  """From `learning_rate` down to 0 at the last update, along a half cosine."""
  return optax.cosine_decay_schedule(learning_rate, decay_steps=max(num_updates, 1))


@SCHEDULES.register('linear')
def linear(learning_rate: float, num_updates: int, *, end_factor: float = 0.0) -> optax.Schedule:
  """From `learning_rate` linearly down to `end_factor` times it at the last update."""
  return optax.linear_schedule(learning_rate, learning_rate * end_factor, max(num_updates, 1))


@SCHEDULES.register('step')
def step(learning_rate: float, num_updates: int, *, boundaries: tuple[float, ...] = (0.5, 0.75),
         factor: float = 0.1) -> optax.Schedule:
  """`learning_rate`, multiplied by `factor` at each boundary (fractions of the run)."""
  if any(not 0 < boundary < 1 for boundary in boundaries):
    raise ValueError(f'boundaries={boundaries!r} must be fractions of the run in (0, 1)')
  return optax.piecewise_constant_schedule(
      learning_rate, {int(boundary * num_updates): factor for boundary in boundaries})


def path_name(path) -> str:
  """'linear2.kernel' for the path of a parameter in an `nnx.State` (its `.value` dropped)."""
  return jax.tree_util.keystr(path, simple=True, separator='.').removesuffix('.value')


@functools.cache
def _compiled(schedule: optax.Schedule) -> Callable[[int], jax.Array]:
  """`schedule` as one compiled program: evaluated op by op, an optax schedule runs (and first
  compiles) a program for each of its dozen operations, each a round trip to the device."""
  return jax.jit(schedule)


@dataclasses.dataclass(frozen=True)
class Optimization:
  """How a run updates its parameters: the optimizer and the learning-rate schedule (each a
  registered plug-in bound to its options), and what the run adds around them."""
  optimizer: Callable[[optax.Schedule], optax.GradientTransformation]
  schedule: Callable[[float, int], optax.Schedule]  # (peak rate, updates it spans)
  learning_rate: float  # The peak.
  warmup_epochs: float = 0.0  # Linear warm-up from 0 before the schedule.
  num_epochs: int = 1
  grad_accum_steps: int = 1  # Steps whose mean gradient makes one update (optax.MultiSteps).
  grad_clip_norm: float = 0.0  # Global-norm clipping; 0 = off.
  freeze: tuple[str, ...] = ()  # Path patterns of parameters not trained.
  lr_multipliers: tuple[tuple[str, float], ...] = ()  # (path pattern, factor) pairs.
  # Layer-wise decay: the learning rate of layer i of a model of layers 0..L is multiplied by
  # layer_decay ** (L - i) (BEiT, timm's `--layer-decay`); 1 = off. Needs `layer_groups`.
  layer_decay: float = 1.0
  layer_groups: models.LayerGroups | None = None  # The model's.
  nonfinite: str = 'halt'  # 'skip': updates with NaN/Inf gradients are skipped.

  def learning_rate_schedule(self, steps_per_epoch: int) -> optax.Schedule:
    """The schedule over the whole run, after `warmup_epochs` of linear warm-up from 0, by
    optimizer update (one every `grad_accum_steps` training steps)."""
    per_epoch = steps_per_epoch / self.grad_accum_steps
    num_updates = int(self.num_epochs * per_epoch)
    warmup_updates = int(self.warmup_epochs * per_epoch)
    schedule = self.schedule(self.learning_rate, num_updates - warmup_updates)
    if not warmup_updates:
      return schedule
    return optax.join_schedules(
        [optax.linear_schedule(0.0, self.learning_rate, warmup_updates), schedule],
        [warmup_updates])

  def learning_rate_at(self, schedule: optax.Schedule, step: int) -> float:
    """The learning rate of training step `step` (1-based)."""
    return float(_compiled(schedule)((step - 1) // self.grad_accum_steps))

  def frozen(self, name: str) -> bool:
    """Whether the parameter or module at path `name` matches a `freeze` pattern."""
    return any(re.search(pattern, name) for pattern in self.freeze)

  def multipliers(self, names: Iterable[str]) -> dict[str, float]:
    """{parameter path: the factor of its learning rate}: 0 when frozen, else its first
    matching `lr_multipliers` factor (paths are dotted, such as 'linear2.kernel'; patterns are
    regular expressions searched in them) times its layer's decay."""
    names = list(names)
    layers, last = (models.layer_numbers(names, self.layer_groups) if self.layer_decay != 1.0
                    else ({}, 0))
    factors = {}
    for name in names:
      factor = next((multiplier for pattern, multiplier in self.lr_multipliers
                     if re.search(pattern, name)), 1.0)
      factors[name] = 0.0 if self.frozen(name) else (
          factor * self.layer_decay ** (last - layers.get(name, last)))
    return factors

  def transform(self, schedule: optax.Schedule, params) -> optax.GradientTransformation:
    """The optimizer driven by `schedule`, with what the run adds around it (see the module
    docstring), for `params` (an `nnx.State` of the model's parameters, or its shapes)."""
    optimizer = self.optimizer(schedule)
    names = [path_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    factors = self.multipliers(names)
    if set(factors.values()) - {1.0}:
      labels = {name: ('frozen' if factor == 0 else 'default' if factor == 1 else f'x{factor}')
                for name, factor in factors.items()}
      transforms = {label: (optax.set_to_zero() if label == 'frozen' else optimizer
                            if label == 'default' else
                            optax.chain(optimizer, optax.scale(factors[name])))
                    for name, label in labels.items()}
      optimizer = optax.multi_transform(transforms, lambda params: (
          jax.tree_util.tree_map_with_path(lambda path, _: labels[path_name(path)], params)))
    if self.grad_clip_norm:
      optimizer = optax.chain(optax.clip_by_global_norm(self.grad_clip_norm), optimizer)
    if self.nonfinite == 'skip':
      optimizer = optax.apply_if_finite(optimizer, MAX_SKIPPED_UPDATES)
    if self.grad_accum_steps > 1:
      optimizer = optax.MultiSteps(optimizer, every_k_schedule=self.grad_accum_steps)
    return optimizer
