"""Data sources: TFDS, image folders, Hugging Face `datasets` or torchvision, behind one interface.

`config.data_source` names a source registered in a module of this package with
`@SOURCES.register(name)`; it is built as `factory(config.dataset, config.data_dir, **options)`
with its options from `config.data_source_options.<name>` (`input_pipeline.Input.source`).
Its metadata (image shape, class names, split sizes) comes first and cheaply, so that config
values can be checked against it; then `load_split` decodes a split into memory as uint8 images
and int32 labels, or, for sources registered with `can_stream=True`, `examples` streams it from
its files. `input_pipeline` resizes, shuffles, augments and batches. A source that needs an
optional package says so with `requires='package'` and imports it inside its factory.

To add a source: a module here with a `base.DataSource` subclass (or a factory returning a
`base.RangeSource`), registered with `@SOURCES.register('name')`.
"""

from core import registry

# Built as factory(config.dataset, config.data_dir, **options).
SOURCES = registry.Registry('data source', key='data_source', package='data_sources',
                            app_args=2)
