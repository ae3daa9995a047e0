"""What a run reads of its own metrics: `<workdir>/metrics.jsonl`, one JSON object per write,
written by the `jsonl` logger in training/loggers.py; the summary, the finished-run check, the
model card and the sweep's pruner read it. Plain Python: the sweep's driver reads it without
starting TensorFlow.
"""

import json
import os

METRICS_FILE = 'metrics.jsonl'


def read_metrics(workdir: str) -> dict[int, dict[str, float]]:
  """{step: {name: value}} of `workdir`'s metrics.jsonl; a later write of a step wins (a
  resumed run writes again the steps after its checkpoint)."""
  path = os.path.join(workdir, METRICS_FILE)
  by_step = {}
  if os.path.exists(path):
    with open(path, encoding='utf-8') as file:
      for line in file:
        try:
          record = json.loads(line)
        except ValueError:  # A line cut short by a killed run.
          continue
        by_step.setdefault(record.pop('step'), {}).update(record)
  return by_step
