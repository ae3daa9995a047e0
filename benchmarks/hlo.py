"""The operations of a compiled XLA module, read from its HLO text: shape, pass, tracing
function and matmul FLOPs of each. `benchmarks/step_profile.py` joins them to a trace's events.

Kept apart from that script (which defines absl flags at import) so tests can import it beside
the other benchmarks, whose flags share names (`--steps`).
"""

import collections
import os
import re
from typing import NamedTuple

import numpy as np


class Operation(NamedTuple):
  """One HLO instruction of the step: what a row of the table says about it."""
  shape: str
  backward: bool
  traced_by: str  # file:function of the innermost Python frame.
  flops: float  # Of its dots, for matmuls (and fusions around one); else 0.


def _table(hlo_text: str, name: str) -> dict[int, str]:
  """One of the HLO text's numbered tables (FileNames, StackFrames, ...); {} if it has none."""
  if f'\n{name}\n' not in hlo_text:
    return {}
  block = hlo_text.split(f'\n{name}\n', 1)[1].split('\n\n', 1)[0]
  return {int(line.split(' ', 1)[0]): line.split(' ', 1)[1] for line in block.splitlines()}


def operations(hlo_text: str) -> dict[str, Operation]:
  """{HLO instruction name: Operation} of the entry computation of a compiled module's text."""
  files, functions = _table(hlo_text, 'FileNames'), _table(hlo_text, 'FunctionNames')
  locations, frames = _table(hlo_text, 'FileLocations'), _table(hlo_text, 'StackFrames')

  def traced_by(frame: str) -> str:
    location = dict(re.findall(r'(\w+)=(\d+)', locations[int(re.search(
        r'file_location_id=(\d+)', frames[int(frame)]).group(1))]))
    file = os.path.basename(files[int(location['file_name_id'])].strip('"'))
    function = functions[int(location['function_name_id'])].strip('"')
    return f'{file}:{function}'

  shapes, computation_flops, found = {}, collections.Counter(), {}
  computation, entry = '', False
  for line in hlo_text.splitlines():
    if header := re.match(r'(ENTRY )?%?([\w.\-]+) \(.*\{$', line):
      entry, computation = bool(header.group(1)), header.group(2)
    match = re.match(r'\s*(?:ROOT )?%?([\w.\-]+) = (\w+\[[\d,]*\])\S* ([\w\-]+)\(', line)
    if not match:
      continue
    name, shape, opcode = match.groups()
    shapes[name] = [int(d) for d in re.findall(r'\d+', shape.split('[')[1])]
    flops = 0.0
    if opcode == 'dot':
      lhs = re.search(r'dot\(%?([\w.\-]+)', line).group(1)
      contracting = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', line).group(1)
      k = np.prod([shapes[lhs][int(d)] for d in contracting.split(',') if d])
      flops = 2.0 * np.prod(shapes[name]) * k
      computation_flops[computation] += flops
    if called := re.search(r'calls=%?([\w.\-]+)', line):
      flops += computation_flops[called.group(1)]
    if not entry:  # Fused and called computations: their callers are the operations run.
      continue
    op_name = re.search(r'op_name="([^"]*)"', line)
    frame = re.search(r'stack_frame_id=(\d+)', line) if frames else None
    found[name] = Operation(shape, bool(op_name and 'transpose(' in op_name.group(1)),
                            traced_by(frame.group(1)) if frame else '', flops)
  return found
