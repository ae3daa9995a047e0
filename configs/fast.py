"""Time-to-accuracy config: the default CNN, one-cycle (warm-up + cosine) SGD, 1 epoch."""

from configs import default


def get_config():
  config = default.get_config()
  config.schedule = 'cosine'  # After the warm-up, anneal to 0 by the last step.
  config.warmup_epochs = 0.2  # A short ramp lets the higher peak rate start stably.
  config.learning_rate = 0.4  # Peak rate: 4x the default's constant rate.
  config.num_epochs = 1  # One annealed epoch: docs/runs/fast*.json.
  # Chosen on a validation slice (train[55000:], seeds 0-2): docs/results.md.
  config.loss_options.cross_entropy.label_smoothing = 0.1
  config.evaluators = 'loss|accuracy'  # Nothing but the eval scalars at each epoch.
  return config
