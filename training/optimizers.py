"""Optax optimizers and learning-rate schedules, chosen by name in the config.

An optimizer is registered with `@OPTIMIZERS.register(name)`: a factory that takes the learning
rate (a schedule) and its options (from `config.optimizer_options.<name>`) and returns an
`optax.GradientTransformation`. A schedule is registered with `@SCHEDULES.register(name)`: a
factory that takes the peak learning rate, the number of optimizer updates it spans and its
options (`config.schedule_options.<name>`). Any schedule can start with a linear warm-up of
`config.warmup_epochs`.
"""

import ml_collections
import optax

from core import registry

OPTIMIZERS = registry.Registry('optimizer', key='optimizer', app_args=1)  # (learning_rate)
# (learning_rate, num_updates)
SCHEDULES = registry.Registry('schedule', key='schedule', app_args=2)
NONFINITE = ('halt', 'skip')
# With config.nonfinite='skip': updates with NaN/Inf gradients skipped in a row before the
# optimizer applies them; the non-finite state is then refused at the next save.
MAX_SKIPPED_UPDATES = 10


def _check_momentum(momentum: float) -> None:
  if not 0 <= momentum < 1:
    raise ValueError(f'momentum={momentum!r} must be in [0, 1) (0 = plain SGD)')


@OPTIMIZERS.register('sgd')
def sgd(learning_rate: optax.Schedule, *, momentum: float = 0.9,
        nesterov: bool = False) -> optax.GradientTransformation:
  """SGD with (heavy-ball or Nesterov) momentum; momentum 0 is plain SGD."""
  _check_momentum(momentum)
  return optax.sgd(learning_rate, momentum=momentum or None, nesterov=nesterov)


@OPTIMIZERS.register('sgd_l2')
def sgd_l2(learning_rate: optax.Schedule, *, momentum: float = 0.9,
           weight_decay: float = 1e-4) -> optax.GradientTransformation:
  """SGD with L2 weight decay added to the gradients, as torch.optim.SGD's weight_decay and the
  classic ResNet recipes apply it."""
  _check_momentum(momentum)
  return optax.chain(optax.add_decayed_weights(weight_decay),
                     optax.sgd(learning_rate, momentum=momentum or None))


@OPTIMIZERS.register('adam')
def adam(learning_rate: optax.Schedule, *, b1: float = 0.9,
         b2: float = 0.999) -> optax.GradientTransformation:
  return optax.adam(learning_rate, b1=b1, b2=b2)


@OPTIMIZERS.register('adamw')
def adamw(learning_rate: optax.Schedule, *, weight_decay: float = 1e-4, b1: float = 0.9,
          b2: float = 0.999) -> optax.GradientTransformation:
  """Adam with decoupled weight decay."""
  return optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay)


@SCHEDULES.register('constant')
def constant(learning_rate: float, num_updates: int) -> optax.Schedule:
  del num_updates  # A constant rate needs none.
  return optax.constant_schedule(learning_rate)


@SCHEDULES.register('cosine')
def cosine(learning_rate: float, num_updates: int) -> optax.Schedule:
  """From `learning_rate` down to 0 at the last update, along a half cosine."""
  return optax.cosine_decay_schedule(learning_rate, decay_steps=max(num_updates, 1))


def updates_per_epoch(config: ml_collections.ConfigDict, steps_per_epoch: int) -> float:
  """Optimizer updates per epoch: one every `config.grad_accum_steps` training steps."""
  return steps_per_epoch / config.grad_accum_steps


def create_learning_rate_schedule(config: ml_collections.ConfigDict,
                                  steps_per_epoch: int) -> optax.Schedule:
  """`config.schedule` over the whole run, after `config.warmup_epochs` of linear warm-up
  from 0, by optimizer update."""
  per_epoch = updates_per_epoch(config, steps_per_epoch)
  num_updates = int(config.num_epochs * per_epoch)
  warmup_updates = int(config.warmup_epochs * per_epoch)
  schedule = SCHEDULES.create(config, config.learning_rate, num_updates - warmup_updates)
  if not warmup_updates:
    return schedule
  return optax.join_schedules(
      [optax.linear_schedule(0.0, config.learning_rate, warmup_updates), schedule],
      [warmup_updates])


def create_optimizer(config: ml_collections.ConfigDict,
                     schedule: optax.Schedule) -> optax.GradientTransformation:
  """`config.optimizer` driven by `schedule`.

  With `config.grad_accum_steps` > 1 it updates the parameters every that many steps, with the
  mean of their gradients (`optax.MultiSteps`). With `config.nonfinite='skip'`, an update whose
  gradients are not finite is skipped (`optax.apply_if_finite`).
  """
  optimizer = OPTIMIZERS.create(config, schedule)
  if config.nonfinite == 'skip':
    optimizer = optax.apply_if_finite(optimizer, MAX_SKIPPED_UPDATES)
  if config.grad_accum_steps > 1:
    optimizer = optax.MultiSteps(optimizer, every_k_schedule=config.grad_accum_steps)
  return optimizer
