"""Timing helpers shared by the benchmarks that run JAX in-process (no flags: each benchmark
defines its own, and absl refuses a flag defined twice)."""

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


def best_time(fn: Callable[[], object], repeats: int = 5) -> float:
  """Seconds of the fastest of `repeats` calls of `fn` (which must block until done)."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def matmul_flops_per_sec(size: int = 2048) -> float:
  """FLOP/s of a float32 size x size matmul in JAX: the peak a train step's FLOP/s is put
  against."""
  a = jnp.ones((size, size), jnp.float32)
  matmul = jax.jit(lambda a: a @ a)
  matmul(a).block_until_ready()
  return 2 * size**3 / best_time(lambda: matmul(a).block_until_ready(), repeats=10)
