"""Reading `sparta train`'s run files: a .toml or .yaml file (see config.py's sections) plus
``--set section.field=value`` overrides, into a validated `RunConfig`.

This module checks what a file adds to the dataclasses: that every key names a field (an
unknown one raises `ConfigError` naming it and listing the known ones) and that every value has
its field's type; the dataclasses check the values themselves.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from sparta.errors import ConfigError

from .config import SECTIONS, RunConfig


def _known(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _type_name(tp: object) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, where: str) -> Any:
    """``value`` as the annotation ``tp`` wants it; ConfigError naming ``where`` if it cannot be."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}={value!r} fits none of {_type_name(tp)}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(
                f"{where}={value!r} is unknown: choose one of {', '.join(map(repr, typing.get_args(tp)))}"
            )
        return value
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}={value!r} must be a list")
        args = typing.get_args(tp)
        item = args[0] if args else Any
        items = [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or tp is tuple else items
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a table of {tp.__name__}'s fields ({', '.join(_known(tp))})")
        return _build(tp, value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}={value!r} must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}={value!r} must be a string")
        return value
    return value  # Any, or a type a file cannot spell: the dataclass checks it


def _build(cls: type, table: Mapping[str, Any], where: str) -> Any:
    """``cls(**table)`` with each key checked against cls's fields and each value against its
    annotation; the dataclass's own __post_init__ checks the values."""
    known = _known(cls)
    unknown = [key for key in table if key not in known]
    if unknown:
        raise ConfigError(
            f"unknown field {where}.{unknown[0]}"
            + (f" (and {', '.join(unknown[1:])})" if unknown[1:] else "")
            + f": the known fields of [{where}] are {', '.join(known)}"
        )
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - annotations a module cannot resolve: leave the types to __post_init__
        hints = {}
    kwargs = {key: _convert(hints.get(key, Any), value, f"{where}.{key}") for key, value in table.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field left out
        raise ConfigError(f"[{where}] {e}: the fields of [{where}] are {', '.join(known)}") from None


def from_dict(tree: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from a file's tree of tables (see the module docstring); validated."""
    if not isinstance(tree, Mapping):
        raise ConfigError(f"a run file must hold tables ({', '.join(SECTIONS)}), not {type(tree).__name__}")
    unknown = [key for key in tree if key not in SECTIONS]
    if unknown:
        raise ConfigError(f"unknown section [{unknown[0]}]: the known sections are {', '.join(SECTIONS)}")
    hints = typing.get_type_hints(RunConfig)
    kwargs: dict[str, Any] = {}
    for section, targets in SECTIONS.items():
        table = tree.get(section, {})
        if not isinstance(table, Mapping):
            raise ConfigError(f"[{section}] must be a table of fields, not {table!r}")
        if len(targets) == 1:
            kwargs[targets[0]] = _build(hints[targets[0]], table, section)
            continue
        # [parallel]: each key goes to the first leaf that has a field of that name
        owners = {name: hints[name] for name in targets}
        parts: dict[str, dict[str, Any]] = {name: {} for name in targets}
        for key, value in table.items():
            owner = next((name for name, cls in owners.items() if key in _known(cls)), None)
            if owner is None:
                known = [k for cls in owners.values() for k in _known(cls)]
                raise ConfigError(
                    f"unknown field {section}.{key}: the known fields of [{section}] are {', '.join(known)}"
                )
            parts[owner][key] = value
        for name, cls in owners.items():
            kwargs[name] = _build(cls, parts[name], section)
    return RunConfig(**kwargs)


def parse_value(text: str) -> Any:
    """A `--set` value: a TOML value (3, 1e-3, true, "x", [1, 2]) or, failing that, the bare string."""
    try:
        return _toml().loads(f"v = {text}")["v"]
    except Exception:  # noqa: BLE001 - anything that is not a TOML value is a string: 1F1B, /tmp/run
        return text


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    """Apply one ``section.field=value`` (or ``parallel.moe.top_k=2``) to the raw tree."""
    key, sep, text = assignment.partition("=")
    path = key.strip().split(".")
    if not sep or len(path) < 2 or not all(path):
        raise ConfigError(f"--set {assignment!r} must read section.field=value, e.g. train.steps=20")
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {assignment!r}: {part} is a value, not a table")
        node = child
    node[path[-1]] = parse_value(text.strip())


def _toml() -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError as e:
            raise ConfigError(
                "reading TOML needs Python 3.11+ (tomllib) or the tomli package: pip install tomli"
            ) from e
    return tomllib


def read_file(path: str | Path) -> dict[str, Any]:
    """The raw tree of a .toml, .yaml or .yml run file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            return _toml().loads(path.read_text())
        except ConfigError:
            raise
        except Exception as e:  # tomllib.TOMLDecodeError, without importing it twice
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
    if suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as e:
            raise ConfigError(f"{path}: YAML run files need PyYAML (pip install pyyaml); or write it as TOML") from e
        try:
            tree = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        return {} if tree is None else tree
    raise ConfigError(f"config file {str(path)!r} must end in .toml, .yaml or .yml")


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """The run of file ``path`` (None: all defaults) with ``overrides`` ("section.field=value")
    applied on top; every value validated, the overrides as strictly as the file."""
    tree = read_file(path) if path is not None else {}
    for assignment in overrides:
        apply_override(tree, assignment)
    try:
        return from_dict(tree)
    except ConfigError as e:
        where = f"{path}" if path is not None else "the defaults"
        raise ConfigError(f"{where}{' with --set' if overrides else ''}: {e}") from None
