"""A trace of a few training steps for TensorBoard's profile plugin (config.profile_steps)."""

from collections.abc import Callable

from clu import periodic_actions
import ml_collections

# Steps run before the trace starts, so that it shows the steady state rather than the first
# dispatches' one-off costs (input pipeline start-up, first transfers).
WARMUP_STEPS = 5


def min_steps(config: ml_collections.ConfigDict) -> int:
  """The fewest training steps in which the trace starts and ends.

  The trace starts and stops where a dispatch ends, up to steps_per_dispatch - 1 steps later
  than asked.
  """
  return WARMUP_STEPS + config.profile_steps + 2 * (config.steps_per_dispatch - 1)


def create_profiler(config: ml_collections.ConfigDict, workdir: str, step: int,
                    steps_per_epoch: int) -> Callable[[int], object]:
  """Traces `config.profile_steps` steps after `WARMUP_STEPS` more steps than `step`.

  The trace goes to <workdir>/plugins/profile/<date>/, where TensorBoard's profile plugin finds
  it. Returns a function to call after every dispatch with the step reached; it does nothing
  when `config.profile_steps` is 0.
  """
  if not config.profile_steps:
    return lambda step: None
  # clu starts the trace at exactly `first_profile`, which must therefore be a step where a
  # dispatch ends: every steps_per_dispatch steps from an epoch's start, and at its end.
  target = step + WARMUP_STEPS
  epoch_start = (target - 1) // steps_per_epoch * steps_per_epoch
  dispatches = -(-(target - epoch_start) // config.steps_per_dispatch)
  first_profile = min(epoch_start + dispatches * config.steps_per_dispatch,
                      epoch_start + steps_per_epoch)
  return periodic_actions.Profile(logdir=workdir, num_profile_steps=config.profile_steps,
                                  profile_duration_ms=None, first_profile=first_profile,
                                  every_secs=None)
