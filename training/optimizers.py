"""Optax optimizers and learning-rate schedules, chosen by name in the config."""

from collections.abc import Callable

import ml_collections
import optax


def _constant(config: ml_collections.ConfigDict, num_steps: int, warmup_steps: int):
  del num_steps, warmup_steps  # A constant rate needs neither.
  return optax.constant_schedule(config.learning_rate)


def _cosine(config: ml_collections.ConfigDict, num_steps: int, warmup_steps: int):
  del warmup_steps
  return optax.cosine_decay_schedule(config.learning_rate, decay_steps=num_steps)


def _warmup_cosine(config: ml_collections.ConfigDict, num_steps: int, warmup_steps: int):
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate, warmup_steps=warmup_steps,
      decay_steps=num_steps, end_value=0.0)


SCHEDULES: dict[str, Callable[..., optax.Schedule]] = {
    'constant': _constant,
    'cosine': _cosine,
    'warmup_cosine': _warmup_cosine,
}

OPTIMIZERS: dict[str, Callable[[optax.Schedule, ml_collections.ConfigDict],
                               optax.GradientTransformation]] = {
    'sgd': lambda lr, config: optax.sgd(lr, momentum=config.momentum or None),
    # SGD with L2 weight decay added to the gradients, as torch.optim.SGD's weight_decay and the
    # classic ResNet recipes apply it.
    'sgd_l2': lambda lr, config: optax.chain(optax.add_decayed_weights(config.weight_decay),
                                             optax.sgd(lr, momentum=config.momentum or None)),
    'adam': lambda lr, config: optax.adam(lr),
    'adamw': lambda lr, config: optax.adamw(lr, weight_decay=config.weight_decay),
}


def create_learning_rate_schedule(config: ml_collections.ConfigDict,
                                  steps_per_epoch: int) -> optax.Schedule:
  """The schedule named by `config.schedule`, spanning the whole run, by optimizer update.

  With gradient accumulation an update comes every `config.grad_accum_steps` training steps,
  so an epoch has `steps_per_epoch / grad_accum_steps` of them.
  """
  updates_per_epoch = steps_per_epoch / config.grad_accum_steps
  return SCHEDULES[config.schedule](
      config, num_steps=int(config.num_epochs * updates_per_epoch),
      warmup_steps=int(config.warmup_epochs * updates_per_epoch))


def learning_rate_by_step(config: ml_collections.ConfigDict,
                          schedule: optax.Schedule) -> optax.Schedule:
  """The learning rate `schedule` gives at each (0-based) training step."""
  return lambda step: schedule(step // config.grad_accum_steps)


def create_optimizer(config: ml_collections.ConfigDict,
                     schedule: optax.Schedule) -> optax.GradientTransformation:
  """The optimizer named by `config.optimizer`, driven by `schedule`.

  With `config.grad_accum_steps` > 1 it updates the parameters every that many steps, with the
  mean of their gradients (`optax.MultiSteps`), and leaves them unchanged in between.
  """
  optimizer = OPTIMIZERS[config.optimizer](schedule, config)
  if config.grad_accum_steps > 1:
    optimizer = optax.MultiSteps(optimizer, every_k_schedule=config.grad_accum_steps)
  return optimizer
