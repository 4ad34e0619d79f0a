"""Typed experiment configs: a recipe YAML plus dotted overrides, checked before any work starts.

Each component defines its own ``Config`` dataclass beside itself (``areal_npu/data/packing.py``
has ``PackingConfig`` ...); :class:`ExperimentConfig` composes them. Loading goes through
OmegaConf structured configs, so unknown keys and wrong types are caught by the schema; every
dataclass may define ``validate()`` for impossible combinations (and ``pre_validate()`` for what
must be settled before its children validate, see :func:`validate_tree`). All failures become
:class:`ConfigError`, which names the dotted key (and a close match for typos); the CLI turns it
into exit code 2 without a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException, ValidationError

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad config value. ``key`` is the dotted path of the offending entry."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


@dataclass
class ExperimentConfig:
    """The whole run. Component sections are added beside the components as they land."""

    name: str = "areal-npu"
    seed: int = 1
    run_dir: str = "runs/${name}"
    device: str = "auto"  # auto | npu | cuda | cpu; validation resolves auto to what this machine has
    #: the dotted keys given as ``a.b.c=value`` overrides (set by :func:`load_config`, not a recipe key):
    #: a section switched off there may leave the recipe's own settings of it unread
    command_line: ClassVar[frozenset[str]] = frozenset()

    def on_command_line(self, key: str) -> bool:
        """Whether an override set ``key`` (or a section holding it)."""
        return any(key == given or key.startswith(given + ".") for given in self.command_line)

    def pre_validate(self) -> None:
        """Resolve ``device`` through the device seam before the components validate against it."""
        if self.device not in ("auto", "npu", "cuda", "cpu"):
            raise ConfigError("device", f"must be one of auto, npu, cuda, cpu; got {self.device!r}")
        from areal_npu.platform import select_device

        try:
            self.device = select_device(self.device).device_type
        except (ValueError, RuntimeError) as exc:  # RuntimeError: AREAL_NPU_DEVICE=npu without an NPU
            raise ConfigError("device", str(exc)) from None

    def validate(self) -> None:
        if not self.name or "/" in self.name:
            raise ConfigError("name", f"must be a non-empty name without '/'; got {self.name!r}")


def _keys_at(default: Any, dotted: str) -> list[str]:
    """The valid field names at the level of ``dotted`` in a default config tree (for suggestions)."""
    node = default
    for part in dotted.split(".")[:-1]:
        node = getattr(node, part, None)
    return [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []


def _deeper(node: Any, leaf: str, prefix: str) -> list[str]:
    """Dotted paths below ``node`` whose last part is ``leaf`` (``train.lr`` -> ``train.optim.lr``)."""
    if not dataclasses.is_dataclass(node):
        return []
    found = []
    for f in dataclasses.fields(node):
        path = f"{prefix}.{f.name}" if prefix else f.name
        child = getattr(node, f.name, None)
        if f.name == leaf and not dataclasses.is_dataclass(child):
            found.append(path)
        found += _deeper(child, leaf, path)
    return found


def _unknown_key_error(schema: type, key: str) -> ConfigError:
    parts = key.split(".")
    leaf, parent = parts[-1], ".".join(parts[:-1])
    candidates = _keys_at(schema(), key)
    close = difflib.get_close_matches(leaf, candidates, n=1, cutoff=0.6)
    if close:
        hint = f"; did you mean {'.'.join(parts[:-1] + [close[0]])!r}?"
    else:
        node = schema()
        for part in parts[:-1]:
            node = getattr(node, part, None)
        below = _deeper(node, leaf, parent)
        hint = f"; did you mean {' or '.join(repr(b) for b in below[:3])}?" if below else ""
    valid = f" Valid keys here: {', '.join(sorted(candidates))}." if candidates and not hint else ""
    return ConfigError(key, f"unknown key{hint}{'.' if valid else ''}{valid}")


def _translate(schema: type, exc: OmegaConfBaseException) -> ConfigError:
    key = str(getattr(exc, "full_key", "") or "")
    if isinstance(exc, ConfigKeyError) or "not in struct" in str(exc).lower():
        return _unknown_key_error(schema, key)
    if isinstance(exc, MissingMandatoryValue):
        return ConfigError(key, "is required but has no value")
    if isinstance(exc, ValidationError):
        message = str(exc).splitlines()[0]
        return ConfigError(key, f"wrong type or value ({message})")
    return ConfigError(key, str(exc).splitlines()[0])


def validate_tree(obj: Any, prefix: str = "") -> None:
    """Check every dataclass in the tree; prefix errors with the path.

    Per node: ``pre_validate()`` first (what the node supports at all, and fields it derives for
    its children, so they validate against the derived values), then the children, then
    ``validate()`` (combinations, which may assume valid children).
    """
    if not dataclasses.is_dataclass(obj):
        return
    _call_check(obj, "pre_validate", prefix)
    for f in dataclasses.fields(obj):
        validate_tree(getattr(obj, f.name), f"{prefix}{f.name}.")
    _call_check(obj, "validate", prefix)


def _call_check(obj: Any, method: str, prefix: str) -> None:
    check = getattr(obj, method, None)
    if check is None:
        return
    try:
        check()
    except ConfigError as exc:
        raise ConfigError(prefix + exc.key, str(exc)[len(exc.key) + 2 :] if exc.key else str(exc)) from None
    except ValueError as exc:
        # Components raise plain ValueError("field_name ..."); point at the field when we can.
        words = str(exc).split()
        names = {f.name for f in dataclasses.fields(obj)}
        key = (
            prefix + words[0].strip(":,'\"`")
            if words and words[0].strip(":,'\"`") in names
            else prefix.rstrip(".")
        )
        raise ConfigError(key, str(exc)) from None


def load_config(schema: type[T], path: str | Path | None = None, overrides: list[str] | tuple = ()) -> T:
    """Schema defaults <- recipe YAML <- ``a.b.c=value`` overrides, typed and validated."""
    base = OmegaConf.structured(schema)
    layers = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("", f"recipe {str(path)!r} does not exist")
        try:
            layers.append(OmegaConf.load(path))
        except Exception as exc:  # noqa: BLE001 - YAML syntax errors come in many types
            raise ConfigError("", f"cannot parse {path}: {exc}") from None
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(item, "overrides look like a.b.c=value")
    try:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(base, *layers)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _translate(schema, exc) from None
    if isinstance(obj, ExperimentConfig):
        obj.command_line = frozenset(item.split("=", 1)[0].strip() for item in overrides)
    validate_tree(obj)
    return obj


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (written into every run directory)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True)


__all__ = ["ConfigError", "ExperimentConfig", "load_config", "to_yaml", "validate_tree"]
