"""The generated photo folders (sample_folders.py): what the folder source reads of them."""

import logging

import numpy as np
import pytest

from data_sources import folder_source
import sample_folders


@pytest.mark.parametrize('kind', list(sample_folders.KINDS))
def test_a_generated_folder_reads_as_its_classes_with_the_messy_files_skipped(tmp_path, caplog,
                                                                              kind):
  root = str(tmp_path / kind)
  names = sample_folders.KINDS[kind][0]
  written = sample_folders.make_kind_folder(root, kind, num_images=8 * len(names))
  with caplog.at_level(logging.WARNING):
    source = folder_source.FolderSource(root)
  assert source.class_names == names
  assert source.num_examples('train') == written == 8 * len(names)
  assert f'Skipped {3 * len(names)} files' in caplog.text  # Each class's 3 unreadable files.
  images = [example['image'] for example in source.examples('train').as_numpy_iterator()]
  assert {image.shape[2] for image in images} == {3}  # Colour, the grayscale ones converted.
  sizes = np.array([image.shape[:2] for image in images])
  assert sizes.min() >= 40 and sizes.max() <= 80 and len(np.unique(sizes, axis=0)) > 1


def test_the_same_seed_writes_the_same_folder_and_another_seed_another(tmp_path):
  read = lambda root: [example['image'] for example in
                       folder_source.FolderSource(root).examples('train').as_numpy_iterator()]
  for name, seed in (('a', 0), ('b', 0), ('c', 1)):
    sample_folders.make_kind_folder(str(tmp_path / name), 'textures', seed=seed,
                                    num_images=8, messy=False)
  first, again, other = (read(str(tmp_path / name)) for name in 'abc')
  assert all(np.array_equal(x, y) for x, y in zip(first, again))
  assert not all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(first, other))


def test_the_command_line_writes_a_folder_and_refuses_a_bad_size_in_one_line(tmp_path):
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  generate = lambda *flags: subprocess.run(
      [sys.executable, '-m', 'sample_folders', *flags], cwd=repo, capture_output=True,
      text=True, timeout=300)
  written = generate('--kind=digits', f'--out={tmp_path}', '--num_images=20', '--size=24',
                     '--split=test')
  assert written.returncode == 0, written.stderr[-3000:]
  assert sorted(os.listdir(tmp_path / 'test')) == list(sample_folders.KINDS['digits'][0])
  assert sum(len(files) for _, _, files in os.walk(tmp_path / 'test')) == 20  # Not messy.
  refused = generate('--kind=shapes', f'--out={tmp_path / "bad"}', '--size=4')
  assert refused.returncode == 1 and refused.stderr.startswith('Flag error: --size=4 ')
  assert len(refused.stderr.strip().splitlines()) == 1 and not (tmp_path / 'bad').exists()


def _batch(seed: int = 0) -> np.ndarray:
  """Two 5x7 RGB images in [0, 1] of different means and contrasts, and a flat one."""
  rng = np.random.default_rng(seed)
  return np.stack([rng.uniform(0.2, 0.4, (5, 7, 3)), rng.uniform(0.0, 1.0, (5, 7, 3)),
                   np.full((5, 7, 3), 0.7)]).astype(np.float32)


def test_standardize_is_tensorflows_per_image_standardization_on_tf_numpy_and_jax_arrays():
  import jax  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from preprocessing import standardize  # pylint: disable=g-import-not-at-top
  images = _batch()
  expected = tf.image.per_image_standardization(images).numpy()
  op = standardize.standardize()
  np.testing.assert_allclose(op(tf.constant(images)).numpy(), expected, atol=1e-5)
  np.testing.assert_allclose(tf.function(op)(tf.constant(images)).numpy(), expected, atol=1e-5)
  np.testing.assert_allclose(np.asarray(op(jax.numpy.asarray(images))), expected, atol=1e-5)
  np.testing.assert_allclose(np.asarray(jax.jit(op)(images)), expected, atol=1e-5)
  np.testing.assert_allclose(op(images), expected, atol=1e-5)
  assert np.abs(expected[2]).max() < 1e-5  # The flat image: finite, thanks to the std's floor.


def test_standardize_per_channel_gives_each_channel_of_each_image_zero_mean_unit_variance():
  import jax  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from preprocessing import standardize  # pylint: disable=g-import-not-at-top
  # Values spread enough that no channel's std is under the floor (1 / sqrt(8 * 9)).
  images = np.random.default_rng(1).uniform(0, 1, (2, 8, 9, 3)).astype(np.float32)
  op = standardize.standardize(per_channel=True)
  for result in (op(tf.constant(images)).numpy(), np.asarray(jax.jit(op)(images))):
    np.testing.assert_allclose(result.mean(axis=(1, 2)), 0, atol=1e-5)
    np.testing.assert_allclose(result.std(axis=(1, 2)), 1, atol=1e-4)
  # A channel's statistics are its own: scaling one channel of the input changes nothing.
  np.testing.assert_allclose(op(images * np.float32([1, 3, 0.5])), op(images), atol=1e-4)


def test_standardize_in_a_preprocess_string_is_the_scale_stage_on_tf_and_jax_arrays():
  import jax  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import preprocessing  # pylint: disable=g-import-not-at-top
  images = tf.constant((_batch() * 255).round().astype(np.uint8))
  parsed = preprocessing.parse('resize(5)|standardize')
  assert parsed.image_shape((5, 7, 3), 'd') == (5, 5, 3)
  expected = tf.image.per_image_standardization(tf.cast(images, tf.float32) / 255).numpy()
  np.testing.assert_allclose(parsed.scale(images).numpy(), expected, atol=1e-5)
  np.testing.assert_allclose(np.asarray(jax.jit(parsed.scale)(images.numpy())), expected,
                             atol=1e-5)


def test_standardize_refuses_a_per_channel_that_is_not_a_bool():
  import preprocessing  # pylint: disable=g-import-not-at-top
  from core import errors  # pylint: disable=g-import-not-at-top
  with pytest.raises(errors.ConfigError) as raised:
    preprocessing.parse('standardize(polarity=1)')
  assert raised.value.key == 'preprocess'


def test_standardize_with_polarity_gives_a_figure_the_same_values_in_any_two_colours():
  import jax  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from preprocessing import standardize  # pylint: disable=g-import-not-at-top
  mask = np.zeros((1, 8, 8, 1), np.float32)
  mask[0, 1:4, 2:6] = 1  # A figure covering less of the image than its background.
  paint = lambda figure, ground: mask * np.float32(figure) + (1 - mask) * np.float32(ground)
  # Every channel's two values far enough apart that its std is over the floor, 1 / 8.
  light_on_dark, dark_on_light = paint([0.9, 0.7, 0.8], [0.1, 0.2, 0.1]), paint(
      [0.1, 0.8, 0.2], [0.6, 0.1, 0.9])
  op = standardize.standardize(per_channel=True, polarity=True)
  for run in (lambda x: op(tf.constant(x)).numpy(), lambda x: np.asarray(jax.jit(op)(x))):
    first, second = run(light_on_dark), run(dark_on_light)
    np.testing.assert_allclose(first, second, atol=1e-5)
    assert np.all(first[mask[..., 0] == 1] > 0) and np.all(first[mask[..., 0] == 0] < 0)
  # Without it, the dark-on-light figure is the negative one in some channels.
  plain = standardize.standardize(per_channel=True)
  assert not np.allclose(plain(light_on_dark), plain(dark_on_light), atol=1e-3)


@pytest.mark.slow  # Trains 1 epoch, then launches main.py --mode=predict.
def test_the_recipe_predicts_a_figure_alike_whatever_its_colours(tmp_path):
  """configs/images.py trains on a small generated folder, then predicts an image and its
  negative (each colour turned to its complement: figure and background swap lightness) with
  the same probabilities: its standardisation reaches predict as it reached training."""
  import csv  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top
  root, workdir, inputs = (str(tmp_path / name) for name in ('folder', 'run', 'inputs'))
  sample_folders.make_kind_folder(root, 'shapes', num_images=64, messy=False)
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  main = lambda *flags: subprocess.run([sys.executable, 'main.py', *flags], cwd=repo,
                                       capture_output=True, text=True, timeout=900)
  # Trained in this process (a main.py start less: training's own CLI is tested elsewhere);
  # predict goes through main.py, which reads the recipe back from the workdir's config.json.
  from configs import images  # pylint: disable=g-import-not-at-top
  import train  # pylint: disable=g-import-not-at-top
  from training import run_spec  # pylint: disable=g-import-not-at-top
  config = images.get_config()
  config.update(dict(dataset=root, num_epochs=1, batch_size=16))
  train.train_and_evaluate(run_spec.resolve(config), workdir)
  os.makedirs(inputs)
  image = Image.open(os.path.join(root, 'train', 'cross', '0001.jpg')).convert('RGB')
  pixels = np.asarray(image)
  Image.fromarray(pixels).save(os.path.join(inputs, 'image.png'))
  Image.fromarray(255 - pixels).save(os.path.join(inputs, 'negative.png'))
  predicted = main(f'--workdir={workdir}', '--mode=predict', f'--inputs={inputs}')
  assert predicted.returncode == 0, predicted.stderr[-3000:]
  with open(os.path.join(workdir, 'predictions.csv'), encoding='utf-8') as file:
    rows = {os.path.basename(row['file']): row for row in csv.DictReader(file)}
  assert rows['image.png']['class'] == rows['negative.png']['class']
  assert float(rows['image.png']['probability']) == pytest.approx(
      float(rows['negative.png']['probability']), abs=1e-3)
