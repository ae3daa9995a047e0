"""Loads triton, when installed, before TensorFlow: import this module before tensorflow.

TensorFlow >= 2.20 loads its bundled LLVM with RTLD_GLOBAL, so a later load of triton's own
LLVM (torchvision pulls triton in through torch) crashes the process with a segfault
(tensorflow/tensorflow#124205). Loaded the other way round, both work.
"""

try:
  import triton  # pylint: disable=unused-import
except ImportError:  # No torch stack installed (or not on Linux): nothing to order.
  pass
