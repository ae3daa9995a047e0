"""Temperature scaling (Guo et al., 2017): one temperature T, fitted on the eval split after
training, divides the logits so that the softmax probabilities match the accuracy; the classes
(the argmax) are unchanged. Eval, predict and every export format apply the workdir's T.

Also what eval and predict apply on top of the model: `scored` wraps a model so that it gives
the log-probabilities after the temperature and, with test-time augmentation ('flip'), the mean
of the softmax over each image and its left-right mirror.
"""

import dataclasses
import json
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from training import parallel
from training import state as state_lib

TEMPERATURE_FILE = 'temperature.json'  # In the workdir: {"temperature": T, ...}.
_MAX_ITERATIONS = 100  # L-BFGS on one parameter converges in a few; a bound for the loop.
_TOLERANCE = 1e-6  # On |d NLL / d log T|.


def saved_temperature(workdir: str, applied: bool = True) -> float:
  """The temperature fitted for `workdir`'s model; 1.0 (the logits as they are) when none was,
  or when not `applied` (config.temperature_scaling turned off for eval, predict or export)."""
  path = os.path.join(workdir, TEMPERATURE_FILE)
  if not applied or not os.path.exists(path):
    return 1.0
  with open(path, encoding='utf-8') as file:
    return float(json.load(file)['temperature'])


class Scored(nnx.Module):
  """`model`'s log-probabilities with the logits divided by `temperature`, averaged (as
  probabilities) over the test-time augmentation's views. Evaluators and predict read them as
  logits: their softmax is the averaged probabilities, their argmax the class."""

  def __init__(self, model: nnx.Module, temperature: float, tta: str | None):
    self.model, self.temperature, self.tta = model, float(temperature), tta

  def __call__(self, images: jax.Array) -> jax.Array:
    views = [images, images[:, :, ::-1]] if self.tta == 'flip' else [images]  # NHWC: mirror W.
    log_probs = jnp.stack([jax.nn.log_softmax(self.model(view).astype(jnp.float32)
                                              / self.temperature) for view in views])
    return jax.nn.logsumexp(log_probs, axis=0) - jnp.log(len(views))


def scored(model: nnx.Module, temperature: float = 1.0, tta: str | None = None) -> nnx.Module:
  """`model` with the temperature and test-time augmentation applied; `model` itself when
  there are neither."""
  return model if temperature == 1.0 and not tta else Scored(model, temperature, tta)


@nnx.jit
def _logits(model: nnx.Module, images: jax.Array) -> jax.Array:
  return model(images).astype(jnp.float32)


def collect_logits(model: nnx.Module, batches) -> tuple[np.ndarray, np.ndarray]:
  """The logits and labels of every real example of `batches` (padded, masked and sharded as
  `input_pipeline.eval_batches` gives them), on every process, in eval mode."""
  logits, labels = [], []
  with state_lib.eval_mode(model):
    for batch in batches:
      real = parallel.to_host(batch['mask'])
      logits.append(parallel.to_host(_logits(model, batch['image']))[real])
      labels.append(parallel.to_host(batch['label'])[real])
  return np.concatenate(logits), np.concatenate(labels)


def nll(logits: jax.Array, labels: jax.Array, temperature=1.0) -> jax.Array:
  """The mean negative log-likelihood of `labels` with the logits divided by `temperature`."""
  return optax.softmax_cross_entropy_with_integer_labels(
      jnp.asarray(logits, jnp.float32) / temperature, jnp.asarray(labels)).mean()


@dataclasses.dataclass(frozen=True)
class Fit:
  temperature: float
  nll_before: float  # At T = 1.
  nll_after: float


def fit_temperature(logits: np.ndarray, labels: np.ndarray) -> Fit:
  """The temperature minimising the NLL of `labels`, found by L-BFGS over log T (T stays
  positive; the NLL is convex in 1/T, so the minimum is the only one)."""
  logits, labels = jnp.asarray(logits, jnp.float32), jnp.asarray(labels)
  objective = lambda log_t: nll(logits, labels, jnp.exp(log_t))
  solver = optax.lbfgs()
  value_and_grad = optax.value_and_grad_from_state(objective)

  def step(carry):
    log_t, state = carry
    value, grad = value_and_grad(log_t, state=state)
    updates, state = solver.update(grad, state, log_t, value=value, grad=grad,
                                   value_fn=objective)
    return optax.apply_updates(log_t, updates), state

  def going(carry):
    _, state = carry
    count = optax.tree_utils.tree_get(state, 'count')
    grad = optax.tree_utils.tree_get(state, 'grad')
    return (count == 0) | ((count < _MAX_ITERATIONS) & (jnp.abs(grad) >= _TOLERANCE))

  start = jnp.zeros((), jnp.float32)
  log_t, _ = jax.jit(lambda: jax.lax.while_loop(going, step, (start, solver.init(start))))()
  temperature = float(jnp.exp(log_t))
  return Fit(temperature, float(nll(logits, labels)), float(nll(logits, labels, temperature)))


def save_temperature(workdir: str, fit: Fit, **details) -> str:
  """Writes `fit` (and `details`: the split, the checkpoint's step) to the workdir's file."""
  path = os.path.join(workdir, TEMPERATURE_FILE)
  with open(path, 'w', encoding='utf-8') as file:
    json.dump({**dataclasses.asdict(fit), **details}, file, indent=2)
  return path
