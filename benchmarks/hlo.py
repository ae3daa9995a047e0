"""The operations of a compiled XLA module, read from its HLO text (shape, pass, tracing
function and matmul FLOPs of each) or from a profiler trace, whose events
`benchmarks/step_profile.py` joins to them (on an accelerator, the trace describes them itself).

Kept apart from that script (which defines absl flags at import) so tests can import it beside
the other benchmarks, whose flags share names (`--steps`).
"""

import collections
import glob
import os
import re
from typing import NamedTuple

import numpy as np
from tensorflow.tsl.profiler.protobuf import xplane_pb2


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


def read_trace(path: str) -> xplane_pb2.XSpace:
  """The trace's XPlane protobuf at `path`: a file, or the one file under a trace directory."""
  if os.path.isdir(path):
    path, = glob.glob(os.path.join(path, '**', '*.xplane.pb'), recursive=True)
  space = xplane_pb2.XSpace()
  with open(path, 'rb') as file:
    space.ParseFromString(file.read())
  return space


def host_events(space: xplane_pb2.XSpace) -> dict[str, float]:
  """{operation name: total picoseconds} over the CPU threads' events: XLA:CPU names each by
  its HLO instruction, alone or at the head of the instruction's text."""
  totals = collections.Counter()
  for plane in space.planes:
    names = {key: re.match(r'%?([^ ]*)', metadata.name).group(1)
             for key, metadata in plane.event_metadata.items()}
    for line in plane.lines:
      for event in line.events:
        totals[names.get(event.metadata_id, '')] += event.duration_ps
  return totals


def device_operations(space: xplane_pb2.XSpace,
                      steps: int) -> list[tuple[float, str, Operation]]:
  """(ms per step, name, Operation) of every operation on an accelerator's 'XLA Ops' line
  ([] without one), as the trace itself describes each: XLA:TPU records the instruction's
  shape, FLOPs, the op's JAX name (backward ops under `transpose`) and its Python source, of
  which the innermost frame outside the installed libraries is kept. Read from the trace, not
  the HLO text: the compiled module names more operations than its entry computation's lines
  give shapes for (multi-output fusions have tuple shapes)."""
  rows = []
  for plane in space.planes:
    lines = [line for line in plane.lines if line.name == 'XLA Ops']
    if not plane.name.startswith('/device:') or not lines:
      continue
    stat_names = {key: metadata.name for key, metadata in plane.stat_metadata.items()}
    totals = collections.Counter()
    for event in lines[0].events:
      totals[event.metadata_id] += event.duration_ps
    for key, picoseconds in totals.items():
      metadata = plane.event_metadata[key]
      stats = {stat_names.get(stat.metadata_id): stat.str_value or stat.int64_value
               or stat.uint64_value or stat.double_value for stat in metadata.stats}
      frames = str(stats.get('source_stack') or stats.get('source') or '').splitlines()
      own = [frame for frame in frames if not re.search(r'(site|dist)-packages|/jax/|/flax/',
                                                         frame)]
      source = os.path.basename((own or frames or [''])[0].rsplit(':', 1)[0]) if frames else ''
      rows.append((picoseconds / 1e9 / steps, metadata.display_name or metadata.name,
                   Operation(re.sub(r'\{[^}]*\}', '', str(stats.get('shape_with_layout', ''))),
                             'transpose' in str(stats.get('tf_op', '')), source,
                             float(stats.get('flops') or 0)
                             if 'convolution' in str(stats.get('hlo_category')) else 0.0)))
  return sorted(rows, reverse=True)


def traced_steps(space: xplane_pb2.XSpace) -> int:
  """How many steps an accelerator's trace holds (its 'Steps' line); 0 if it has none."""
  return max((len(line.events) for plane in space.planes if plane.name.startswith('/device:')
              for line in plane.lines if line.name == 'Steps'), default=0)
