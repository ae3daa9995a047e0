"""The published figures: a number cited on the same line as a link to its JSON artefact is in
that artefact (docs/ and the README)."""

import glob
import json
import math
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DOCS = sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md'))) + [os.path.join(ROOT, 'README.md')]
_LINK = re.compile(r'\]\(([^)#]+\.json)\)')
# A figure: thousands separated (2,393) or with decimals (48.0), then maybe % or x.
_FIGURE = re.compile(r'(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+\.\d+)(%|x)?(?![\w.])')


def _numbers(value, found: list, key: str = '', sample: bool = False) -> list:
  """Every number in a JSON value as (the key it is under, whether it is one sample of many:
  in a list of numbers or under a key of rounds, the number); strings' numbers included (a
  command's flags)."""
  if isinstance(value, dict):
    for name, item in value.items():
      _numbers(item, found, name, sample or 'round' in name)
  elif isinstance(value, list):
    for item in value:
      _numbers(item, found, key, sample or not isinstance(item, dict))
  elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
    found.append((key, sample, float(value)))
  elif isinstance(value, str):
    found.extend((key, True, float(number)) for number in re.findall(r'\d+\.\d+|\d+', value))
  return found


def _in_artefact(text: str, unit: str | None, numbers: list) -> bool:
  """Whether the figure `text` (with `unit`) is one of `numbers` rounded as shown: a percentage
  as a fraction or as itself; a ratio ('x') also as the ratio of two numbers of one key that
  are not samples (a measure's two sides; the many samples would match by chance)."""
  shown = float(text.replace(',', ''))
  decimals = len(text.split('.')[1]) if '.' in text else 0
  scales = (100.0,) if unit == '%' else (1.0, 100.0)
  if any(round(number * scale, decimals) == shown for _, _, number in numbers for scale in scales):
    return True
  sides = {}
  for key, sample, number in numbers:
    if number > 0 and not sample:
      sides.setdefault(key, set()).add(number)
  return unit == 'x' and any(round(a / b, decimals) == shown
                             for values in sides.values() for a in values for b in values)


def test_figures_next_to_an_artefact_link_are_in_the_artefact():
  unmatched, checked = [], 0
  for doc in _DOCS:
    with open(doc, encoding='utf-8') as file:
      lines = file.readlines()
    for number, line in enumerate(lines, 1):
      numbers = []
      for link in _LINK.findall(line):
        path = os.path.normpath(os.path.join(os.path.dirname(doc), link))
        assert os.path.isfile(path), f'{doc}:{number} links to a missing artefact {link}'
        with open(path, encoding='utf-8') as file:
          _numbers(json.load(file), numbers)
      if not numbers:
        continue
      for figure in _FIGURE.finditer(_LINK.sub('', line)):
        checked += 1
        if not _in_artefact(figure.group(1), figure.group(2), numbers):
          unmatched.append(f'{os.path.relpath(doc, ROOT)}:{number}: {figure.group(0)}')
  assert checked > 10  # The check reads the docs' figures at all.
  assert not unmatched, unmatched


def _commands(text: str) -> list[str]:
  """The shell commands a doc gives: lines of its indented code blocks (continuation lines
  joined) and inline code spans, that run Python."""
  found = []
  for block in re.findall(r'((?:^    \S.*\n(?:^      .*\n)*)+)', text, re.M):
    found += re.sub(r'\\\n\s*', ' ', block).splitlines()
  found += re.findall(r'`((?:taskset -c [\d,]+ )?python [^`]+)`', text)
  return [line.split('  #')[0].strip() for line in found
          if line.strip().startswith(('python ', 'taskset '))]


def test_a_documented_command_is_the_command_its_artefact_records():
  """A command in the docs whose --json or --out names a committed artefact's file is the
  command that wrote it (its output path included), as the artefact records it; a `taskset`
  prefix aside."""
  differing, checked = [], 0
  for doc in _DOCS:
    with open(doc, encoding='utf-8') as file:
      commands = _commands(file.read())
    for command in commands:
      if not (out := re.search(r'--(?:json|out)=(\S+?\.json)\b', command)):
        continue
      name = os.path.basename(out.group(1))
      for path in (os.path.join(ROOT, 'docs', 'runs', name), os.path.join(ROOT, 'docs', name)):
        if os.path.isfile(path):
          with open(path, encoding='utf-8') as file:
            recorded = json.load(file)['command']
          checked += 1
          shown = re.sub(r'^taskset -c [\d,]+ ', '', command)
          if shown.replace("'", '').split() != recorded.replace("'", '').split():
            differing.append(f'{os.path.relpath(doc, ROOT)}: {command} (recorded: {recorded})')
          break
  assert checked > 10  # The check finds the docs' commands at all.
  assert not differing, differing
