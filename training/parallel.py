"""Data parallelism and FSDP over every device of every process, with JAX's own runtime and
shardings.

The mesh has two axes, ('data', 'fsdp'), of config.fsdp devices along 'fsdp' (1 by default) and
the rest along 'data'. Every batch is split over both, so each device gets its share of it.
With config.fsdp = 1 the parameters, optimizer state and metrics are replicated: plain data
parallelism. With config.fsdp = N, each parameter and optimizer array of at least
`MIN_SHARDED_SIZE` elements is split over the N devices of its 'fsdp' row along its largest
dimension that N divides (Zhao et al. 2023's fully sharded data parallelism, big_vision's and
MaxText's 'fsdp' rule): a model N times larger than one device's memory share fits. Under `jit`,
XLA inserts the collectives itself (the gradient reductions, the gathers of sharded weights,
BatchNorm's batch statistics, metric sums), so the model and step code are unchanged and N
devices compute what one device computes on the same global batch.

With several processes (one per host), each reads only its own slice of every split
(`input_pipeline.process_split`) and feeds its share of each global batch
(`jax.make_array_from_process_local_data`). Every process must run the same number of steps, or
the collectives hang:
  * train: the split is cut into equal per-process slices, dropping the at most
    `process_count - 1` examples left over (`drop_remainder=True`); every process then has the
    same number of full batches per epoch.
  * eval: nothing is dropped; every process pads its slice to the same number of batches and the
    padding is masked out, so each example counts exactly once.
"""

import math

from absl import logging
import jax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from core import errors


def initialize(coordinator_address: str | None, num_processes: int | None,
               process_id: int | None) -> None:
  """Joins the multi-process JAX runtime; must run before anything touches a device.

  With no arguments, JAX detects the clusters it knows (SLURM, Open MPI, Cloud TPU, GKE, ...)
  and otherwise this stays a single process. So it does where JAX sees signs of a cluster but
  cannot read it (a TPU host or container that cannot reach the metadata server JAX asks for
  the slice's hosts, an Open MPI variable it cannot parse): a single host's devices still work
  without joining anything, as they do for any JAX program that never calls `initialize`, and
  a warning names the cause and the flags that join a cluster explicitly. `num_processes=1`
  alone runs a single process without asking: JAX's detection retries for seconds on a TPU
  host that cannot reach its metadata server.
  """
  if num_processes == 1 and coordinator_address is None and process_id in (None, 0):
    logging.info('One process (--num_processes=1): no cluster detection.')
    return
  if (coordinator_address, num_processes, process_id) == (None, None, None):
    try:
      jax.distributed.initialize()
    except ValueError:  # No known cluster: JAX lacks a coordinator address.
      logging.info('No cluster detected: running as a single process.')
    except jax.errors.JaxRuntimeError:  # The cluster was read; its service failed to start
      raise  # or to connect: joining failed, and a process alone must not train on.
    # JAX's detection raises RuntimeError of its own and the `requests` library's errors (an
    # OSError) for a metadata server out of reach; the runtime is then still unstarted.
    except (RuntimeError, OSError) as error:
      logging.warning('JAX found signs of a cluster but could not read it (%s: %s): running as '
                      'a single process (--num_processes=1 skips the detection). To join several '
                      'processes, pass --coordinator_address, --num_processes and --process_id '
                      '(docs/launch.md).',
                      type(error).__name__, str(error).split('\n', 1)[0][:200])
    return
  try:
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
  except (TypeError, ValueError) as error:
    raise errors.FlagError(
        f'--coordinator_address={coordinator_address} --num_processes={num_processes} '
        f'--process_id={process_id} cannot start a multi-process run ({error}): pass HOST:PORT of '
        'process 0, the same --num_processes everywhere, and a distinct --process_id in '
        '[0, num_processes) on each process.', flag='process_id',
        value=(coordinator_address, num_processes, process_id)) from error


DATA, FSDP = 'data', 'fsdp'
BATCH = P((DATA, FSDP))  # A batch's first axis is split over every device.
# Smaller arrays (biases, norms' scales, the step count) stay whole on every device: splitting
# them saves little memory and adds a collective each.
MIN_SHARDED_SIZE = 1 << 16


def create_mesh(fsdp: int = 1) -> jax.sharding.Mesh:
  """A mesh over all devices of all processes: axes ('data', 'fsdp'), `fsdp` devices along
  'fsdp' (config.fsdp), the others along 'data'.

  Pass it to `jax.set_mesh` before creating the training state (`training.state.create` places
  its arrays by `state_sharding`), so that the train and eval steps see one layout and compile
  once.
  """
  if fsdp < 1 or jax.device_count() % fsdp:
    raise errors.ConfigError(
        f'config.fsdp={fsdp} does not divide the {jax.device_count()} devices: set it to a '
        'divisor of the device count (1: data parallelism alone).', key='fsdp', value=fsdp)
  # Auto axes: XLA propagates shardings from the inputs, so model code needs no annotations.
  return jax.make_mesh((jax.device_count() // fsdp, fsdp), (DATA, FSDP),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def state_sharding(mesh: jax.sharding.Mesh, shape: tuple[int, ...]) -> NamedSharding:
  """Where a training state's array of `shape` lives: split over 'fsdp' along its largest
  dimension that the axis divides (the first of equal ones), if it has `MIN_SHARDED_SIZE`
  elements or more; else replicated."""
  size = mesh.shape.get(FSDP, 1)
  if size > 1 and math.prod(shape) >= MIN_SHARDED_SIZE:
    for axis in sorted(range(len(shape)), key=lambda axis: -shape[axis]):
      if shape[axis] % size == 0:
        return NamedSharding(mesh, P(*(FSDP if i == axis else None for i in range(len(shape)))))
  return NamedSharding(mesh, P())


def shard(batch: dict[str, np.ndarray], mesh: jax.sharding.Mesh):
  """Global arrays from this process's share of a batch, split along its first axis."""
  if jax.process_count() == 1:  # The share is the whole batch: `device_put` places it with
    return jax.device_put(batch, _batch_sharding(mesh))  # less host work, every step.
  return jax.make_array_from_process_local_data(_batch_sharding(mesh), batch)


def abstract_batch(shapes: dict[str, tuple[tuple[int, ...], np.dtype]],
                   mesh: jax.sharding.Mesh) -> dict[str, jax.ShapeDtypeStruct]:
  """What `shard` makes of a batch with these global (shape, dtype)s, for compiling ahead."""
  return {name: jax.ShapeDtypeStruct(shape, dtype, sharding=_batch_sharding(mesh))
          for name, (shape, dtype) in shapes.items()}


def _batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, BATCH)


def to_host(array: jax.Array) -> np.ndarray:
  """The whole global `array` as a NumPy array on every process (a collective: all must call)."""
  return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def to_process_local(array: jax.Array) -> np.ndarray:
  """This process's rows of a global `array` split over the devices (`shard`'s inverse), on
  the host."""
  return np.asarray(multihost_utils.global_array_to_host_local_array(
      array, array.sharding.mesh, BATCH))


def sum_over_processes(array: np.ndarray) -> np.ndarray:
  """The sum of each process's `array` (every process calls it: a collective)."""
  if jax.process_count() == 1:
    return array
  return np.asarray(multihost_utils.process_allgather(array)).sum(axis=0)


def local_batch_size(global_batch_size: int) -> int:
  """This process's share of each global batch."""
  return global_batch_size // jax.process_count()


def round_up(size: int, mesh: jax.sharding.Mesh) -> int:
  """`size` rounded up to a multiple of the mesh's device count (a batch splits evenly)."""
  return -(-size // mesh.size) * mesh.size
