"""Reading a config: a TOML file, then `--set section.key=value` overrides, then flags, each key
checked for its type as it is set (`apply_section`); then the sizes a model's own config.json or
its preset gives (`resolve_presets`), then every value checked (validate.py)."""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from shardwise.config.schema import (
    GPT_PRESET_SIZES,
    GPT_PRESETS,
    HF_FAMILY_SIZES,
    HF_MODEL_TYPES,
    HF_SIZE_NAMES,
    LANGUAGE_MODELS,
    MOE_MODELS,
    MOVED_KEYS,
    SECTIONS,
    Config,
    ConfigError,
    ModelConfig,
)
from shardwise.config.transformers_file import read_transformers_config
from shardwise.validate import validate


def _allowed_types(annotation: Any) -> tuple[type, ...]:
    hints = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return tuple(h for h in hints if h is not type(None))


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    if value is None:
        return None
    allowed = _allowed_types(annotation)
    kind = type(value)
    if kind in allowed:
        return value
    if list[str] in allowed:
        if kind is list and all(type(item) is str for item in value):
            return value
        raise ConfigError(f"{key} = {value!r}: expected a list of strings, e.g. [\"q_proj\", \"v_proj\"]")
    if list[int] in allowed:
        if kind is list and all(type(item) is int for item in value):
            return value
        raise ConfigError(f"{key} = {value!r}: expected a list of integers, e.g. [3]")
    if float in allowed and kind is int:
        return float(value)
    names = " or ".join(t.__name__ for t in allowed)
    raise ConfigError(f"{key} = {value!r}: expected {names}, got {kind.__name__}")


def apply_section(cfg: Config, section: str, values: dict[str, Any], origin: str) -> None:
    """Set `values` (by key) in `cfg`'s [section], each checked for its key and type; a key may be
    dotted (`pipeline.schedule`) or a table (`[parallel.pipeline]`) for a section's own tables."""
    if section not in SECTIONS:
        raise ConfigError(f"[{section}] in {origin}: unknown section; allowed: {', '.join(SECTIONS)}")
    _apply_table(getattr(cfg, section), section, values, origin)


def _apply_table(target: Any, name: str, values: Any, origin: str) -> None:
    if not isinstance(values, dict):
        raise ConfigError(f"{name} in {origin}: expected a [{name}] table, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(target)}
    hints = typing.get_type_hints(type(target))
    for dotted, value in values.items():
        key, _, rest = dotted.partition(".")
        if key not in fields:
            moved = MOVED_KEYS.get(f"{name}.{dotted}")
            if moved is not None:
                raise ConfigError(f"{name}.{dotted} in {origin}: moved to {moved}")
            raise ConfigError(f"{name}.{dotted} in {origin}: unknown key; allowed in [{name}]: {', '.join(fields)}")
        inner = getattr(target, key)
        if dataclasses.is_dataclass(inner):
            _apply_table(inner, f"{name}.{key}", {rest: value} if rest else value, origin)
        elif rest:
            raise ConfigError(f"{name}.{dotted} in {origin}: {name}.{key} is a value, not a table")
        else:
            setattr(target, key, _coerce(f"{name}.{key}", value, hints[key]))


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=value`, the value read as a TOML literal (bare words are strings)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set train.lr=3e-4")
    dotted, raw = text.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return section, key, value


def load_config(
    path: str | Path | None = None,
    overrides: list[str] = (),
    flags: dict[str, Any] | None = None,
) -> Config:
    """Build a config from a TOML file, `--set` overrides and flags (dotted keys), in that order,
    then validate it. Raises ConfigError on the first bad value."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r}: not found")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r}: not valid TOML ({exc})") from None
        for section, values in data.items():
            apply_section(cfg, section, values, str(path))
    for text in overrides:
        section, key, value = parse_override(text)
        apply_section(cfg, section, {key: value}, "--set")
    for dotted, value in (flags or {}).items():
        if value is not None:
            section, key = dotted.split(".", 1)
            apply_section(cfg, section, {key: value}, f"--{key.replace('_', '-')}")
    resolve_presets(cfg)
    validate(cfg)
    return cfg


def read_hf_config(path: str) -> tuple[str, dict[str, tuple[str, int]]]:
    """The family (model.name) a transformers config.json builds and the sizes it gives, by
    ModelConfig key, each with the file's name for it, read through the family's config class (its
    attribute_map: GPT-2's n_embd is its hidden_size); ConfigError if the file is missing, not JSON,
    or of a model_type transformers does not build as a causal LM."""
    key = f"model.hf_config = {path!r}"
    try:
        values = read_transformers_config(path)
    except FileNotFoundError:
        raise ConfigError(f"{key}: no such file; give the path of a transformers config.json") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: not a JSON transformers config ({exc})") from None
    model_type = values.get("model_type") if isinstance(values, dict) else None
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        raise ConfigError(f"{key}: reading it needs transformers; pip install 'shardwise[hf]'") from None
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"{key}: model_type {model_type!r} is not a family transformers "
                          f"{transformers.__version__} builds as a causal LM (AutoModelForCausalLM)")
    name = HF_MODEL_TYPES.get(model_type, "hf")
    try:
        config = transformers.AutoConfig.for_model(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key}: transformers' {model_type} config refuses it ({exc})") from None
    renamed = type(config).attribute_map  # the standard name -> the family's own
    sizes = {}
    for ours in HF_FAMILY_SIZES[name]:
        for standard in HF_SIZE_NAMES[ours]:
            theirs = renamed.get(standard, standard)
            in_file = next((k for k in values if renamed.get(k, k) == theirs), None)
            try:
                value = getattr(config, standard, None)
            except Exception:  # noqa: BLE001 - a size that varies by layer (Gemma 4's head_dim): none whole
                value = None
            if isinstance(value, int) and not isinstance(value, bool) and (in_file or name == "hf"):
                sizes[ours] = (in_file or theirs, value)
                break
    return name, sizes


def hf_config_overrides(path: str | None) -> list[str]:
    """`--set` overrides that make the model the one a transformers config.json describes (the
    flag `--hf-config` of `shardwise train` and `plan`): its family and the file, whose sizes the
    model then takes (`resolve_presets`). `path` may name the file or the model's directory."""
    if path is None:
        return []
    if Path(path).is_dir():
        path = str(Path(path) / "config.json")
    name, _ = read_hf_config(path)
    return [f"model.name={name}", f"model.hf_config={json.dumps(path)}"]


def resolve_presets(cfg: Config) -> None:
    if cfg.data.format != "text" and cfg.data.documents == "none":
        cfg.data.documents = "files"  # fine-tuning samples are packed, each its own document
    m = cfg.model
    if m.hf_config is not None:
        _take_hf_sizes(m)
    if m.name in LANGUAGE_MODELS:
        if m.preset not in GPT_PRESET_SIZES:
            raise ConfigError(f"model.preset = {m.preset!r}: unknown; allowed: {', '.join(GPT_PRESETS)}")
        for key, value in GPT_PRESET_SIZES[m.preset].items():
            if getattr(m, key) is None:
                setattr(m, key, value)
        if m.n_kv_head is None:
            m.n_kv_head = m.n_head
        if m.d_ff is None:
            m.d_ff = 4 * m.d_model
    if m.name == "hf-qwen3-moe" and m.head_dim is None:
        m.head_dim = m.d_model // m.n_head
    if m.name in MOE_MODELS:
        m.n_experts = 8 if m.n_experts is None else m.n_experts
        m.top_k = 2 if m.top_k is None else m.top_k
        if m.d_expert is None or m.name == "hf-mixtral":
            m.d_expert = m.d_ff


def _take_hf_sizes(m: ModelConfig) -> None:
    """The one rule of precedence: model.hf_config gives the model its sizes. A size set beside it
    must agree; model.seq_len, the training window, may be shorter than the file's context."""
    family, sizes = read_hf_config(m.hf_config)
    if m.name != family:
        raise ConfigError(f"model.hf_config = {m.hf_config!r}: builds {family}, but model.name = {m.name!r}; "
                          f"set model.name = {family!r}")
    for key, (theirs, value) in sizes.items():
        mine = getattr(m, key)
        if mine is None:
            setattr(m, key, value)
        elif key == "seq_len" and mine > value:
            raise ConfigError(f"model.seq_len = {mine}: longer than the context of model.hf_config = "
                              f"{m.hf_config!r} ({theirs} = {value}); train on windows of at most {value}")
        elif key != "seq_len" and mine != value:
            raise ConfigError(f"model.{key} = {mine}: model.hf_config = {m.hf_config!r} says {theirs} = {value}, "
                              f"and a model's config.json gives its sizes; leave model.{key} unset")
