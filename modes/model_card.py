"""The model card written next to every export: `model_card.json` (for programs) and
`model_card.md` (for people).

It says what the exported model takes and gives (classes; the input's shape, dtype, range and
whether its size is fixed; the preprocessing inside; the temperature dividing the logits), how
it was trained (the workdir's saved config, its final and test metrics from metrics.jsonl) and
where it came from (the workdir's provenance records: package versions, git commit, the data's
fingerprint; and the environment of the export itself).
"""

import datetime
import json
import os

from core import saved_config
from data_sources import base
from training import provenance
from training import summaries
from training import workdirs

JSON_FILE = 'model_card.json'
MARKDOWN_FILE = 'model_card.md'
_TEST_PREFIX = 'test/'


def final_metrics(workdir: str) -> tuple[dict, dict]:
  """({name: value} of each metric at its last step, the same for the test split's) from
  `workdir`'s metrics.jsonl."""
  latest = {}
  for _, values in sorted(summaries.read_metrics(workdir).items()):
    latest.update(values)
  final = {name: value for name, value in latest.items() if not name.startswith(_TEST_PREFIX)}
  test = {name: value for name, value in latest.items() if name.startswith(_TEST_PREFIX)}
  return final, test


def card(workdir: str, *, export_format: str, model_path: str, usage: str,
         format_details: dict, step: int, info: base.DatasetInfo, any_size: bool,
         preprocess: str, preparation: str, temperature: float) -> dict:
  """The model card's content (JSON values). `usage`: the Python line that runs the model;
  `format_details`: the format's own entries; `preparation`: the image ops (config.preprocess's
  language) that make an image of any size the model-size image."""
  height, width, channels = info.image_shape
  config = saved_config.read(workdir)
  final, test = final_metrics(workdir)
  return {
      'format': export_format,
      'model': os.path.basename(model_path),
      'usage': usage,
      'format_details': format_details,
      'checkpoint_step': step,
      'exported': datetime.datetime.now().isoformat(timespec='seconds'),
      'classes': list(info.class_names),
      'input': {'name': 'images', 'dtype': 'uint8', 'range': [0, 255],
                'shape': ['batch', None if any_size else height, None if any_size else width,
                          channels],
                'fixed_size': not any_size, 'training_size': [height, width]},
      'output': {'name': 'logits', 'dtype': 'float32', 'shape': ['batch', info.num_classes],
                 'divided_by_temperature': temperature},
      'preprocessing': {
          'config_preprocess': preprocess,
          'prepare': preparation,
          'inside': (f'{preparation} (the eval resize and crop), then the scale stage'
                     if any_size else 'the scale stage only'),
          'before': None if any_size else (
              f'{preparation}: the eval resize and crop, to {height}x{width} uint8 images '
              '(docs/export.md)')},
      'temperature': temperature,
      'config': config.to_dict() if config is not None else None,
      'metrics': {'final': final, 'test': test},
      'provenance': {'training': provenance.records(workdir),
                     'export': provenance.environment()},
  }


def write(directory: str, workdir: str, **details) -> dict:
  """Writes the model card of an export (`card`'s `details`) into `directory`; returns it."""
  content = card(workdir, **details)
  workdirs.write_json(os.path.join(directory, JSON_FILE), content)
  with open(os.path.join(directory, MARKDOWN_FILE), 'w', encoding='utf-8') as file:
    file.write(markdown(content))
  return content


def markdown(content: dict) -> str:
  """The card as Markdown."""
  shape = content['input']['shape']
  preprocessing = content['preprocessing']
  size = (f"fixed: prepare each image by {preprocessing['prepare']} first" if
          content['input']['fixed_size'] else f"any (made the model's size inside by "
          f"{preprocessing['prepare']})")
  training = content['provenance']['training']
  first = training[0] if training else {}
  git = first.get('git') or {}
  lines = [
      f"# Model card: {content['model']} ({content['format']})", '',
      f"Checkpoint step {content['checkpoint_step']}, exported {content['exported']}.", '',
      '## Use', '', '```python', f"logits = {content['usage']}", '```', '',
      '| | |', '| --- | --- |',
      f"| input `images` | uint8, pixels 0-255, shape {shape} (batch, height, width, channels) |",
      f'| input size | {size}: {content["input"]["training_size"]} |',
      f"| output `logits` | float32, shape {content['output']['shape']}, divided by the "
      f"temperature {content['temperature']:.4g}; softmax gives the probabilities |",
      f"| preprocessing | config.preprocess={preprocessing['config_preprocess']!r}; "
      f"before the model: {preprocessing['before'] or 'nothing'}; inside the model: "
      f"{preprocessing['inside']} |",
      f"| classes ({len(content['classes'])}) | {', '.join(content['classes'])} |", '',
      f"## The {content['format']} export", '', '| | |', '| --- | --- |',
      *(f'| {name} | {value} |' for name, value in content['format_details'].items()), '',
      '## Metrics', '', '| metric | value |', '| --- | --- |',
      *(f'| {name} | {value:.6g} |' for name, value in
        {**content['metrics']['final'], **content['metrics']['test']}.items()
        if isinstance(value, (int, float))), '',
      '## Provenance', '',
      f"Trained from git commit {git.get('commit', 'unknown (not a git checkout)')}"
      f"{' with uncommitted changes' if git.get('dirty') else ''}, Python "
      f"{first.get('python', '?')}, packages {first.get('packages', {})}.", '',
      f"Data: {json.dumps(first.get('data'))}", '',
      f'{len(training)} training start(s) recorded; every record, the export\'s environment '
      'and the training config are in model_card.json.', '',
  ]
  return '\n'.join(lines)
