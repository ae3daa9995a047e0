"""What a test needs that may be missing: the optional extras (requirements-extras.txt), skipped
naming the extra, and the CI's copy of the original MNIST files (../shared)."""

import pathlib

import pytest

SHARED_MNIST = pathlib.Path(__file__).resolve().parents[3] / 'shared' / 'datasets' / 'mnist'


def requires_extras(*packages: str) -> None:
  """Skips the calling test (or fixture) unless the optional packages it needs are installed."""
  for package in packages:
    pytest.importorskip(package, reason=f'{package!r} is an optional extra: pip install -r '
                        'requirements-extras.txt')
