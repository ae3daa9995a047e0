"""benchmarks/fine_tune_race.py's table: each side's row against the app's time for its model."""

from benchmarks import fine_tune_race


def _row(model: str, side: str, wall_s: float, **extra) -> dict:
  return {'model': model, 'side': side, 'wall_s': wall_s, 'peak_rss_mb': 2048,
          'images_per_sec': [10.0, 12.5], 'accuracy': [0.5, 0.75], **extra}


def test_each_timm_row_is_set_against_the_app_row_of_its_model():
  rows = [_row('resnet18', 'app', 90.0), _row('resnet18', 'timm', 60.0, dataloader_workers=2,
                                              worker_peak_rss_mb=1024),
          _row('vit_small_patch16_224', 'app', 100.0),
          _row('vit_small_patch16_224', 'timm', 200.0, dataloader_workers=2,
               worker_peak_rss_mb=1024)]
  lines = fine_tune_race.table(rows).splitlines()
  cells = [[cell.strip() for cell in line.strip('|').split('|')] for line in lines[2:]]
  assert [row[:4] for row in cells] == [['resnet18', 'app', '90', '1'],
                                        ['resnet18', 'timm', '60', '1.50'],
                                        ['vit_small_patch16_224', 'app', '100', '1'],
                                        ['vit_small_patch16_224', 'timm', '200', '0.50']]
  assert cells[0][4:] == ['10.0, 12.5', '50.0%, 75.0%', '2.0']
  assert cells[1][6] == '2.0 (+2 workers, 1.0 each at most)'
