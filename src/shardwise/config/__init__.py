"""The run's config, by concern: its schema (schema.py: every section and key, with its default,
its type and what it does), how a config is read (load.py: a TOML file, then `--set`
overrides, then flags; presets and a model's own config.json filled in) and how it is checked
(validate.py: every value and every relation between values, before any worker starts). Every bad
value raises `ConfigError` with one line naming the key, the value and what is allowed."""
