"""The ``param`` machinery: a config field declared once with its default, its check (choices,
bounds) and, in the docstring under it, its documentation; ``check_fields`` runs the checks."""

from __future__ import annotations

from dataclasses import field
from collections.abc import Mapping
from typing import Any
import dataclasses

from omegaconf import MISSING, DictConfig, OmegaConf

from ppo_lightning.config.errors import ConfigError


def param(
    default: Any = MISSING, *, factory=None, choices=None, gt=None, ge=None, lt=None, le=None, hint: str | None = None
):
    """A config field with its check: ``choices`` (a registry: any iterable of the allowed
    values), bounds ``gt``/``ge``/``lt``/``le``, and a ``hint`` appended to the error message.
    A null value (an optional key left unset) is never checked."""
    meta = {k: v for k, v in dict(choices=choices, gt=gt, ge=ge, lt=lt, le=le, hint=hint).items() if v is not None}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def get_key(node: Any, key: str, default: Any = None) -> Any:
    """``node.key`` of a DictConfig, a dict or a dataclass (None: no node); ``default`` where the
    key is absent or null. How code below the jobs reads a config node it may be handed in any of
    these forms (a composed config, a test's dict, a ``to_object`` dataclass)."""
    if node is None:
        return default
    value = node.get(key, default) if isinstance(node, Mapping) else getattr(node, key, default)
    return default if value is None else value


def describe_check(meta: dict) -> str:
    """The check of a field in words: ``> 0``, ``in [0, 1]``, ``one of k1 | k2 | k3``."""
    if "choices" in meta:
        return "one of " + " | ".join(str(c) for c in meta["choices"])
    lo = ("(", meta["gt"]) if "gt" in meta else ("[", meta["ge"]) if "ge" in meta else None
    hi = (")", meta["lt"]) if "lt" in meta else ("]", meta["le"]) if "le" in meta else None
    if lo and hi:
        return f"in {lo[0]}{lo[1]}, {hi[1]}{hi[0]}"
    if lo:
        return f"{'>' if lo[0] == '(' else '>='} {lo[1]}"
    if hi:
        return f"{'<' if hi[0] == ')' else '<='} {hi[1]}"
    return ""


def check_fields(node: Any, cls: type, prefix: str = "") -> None:
    """Check every field of dataclass ``cls`` in ``node`` (a DictConfig, a dataclass or a dict)
    against its ``param`` check; raises ``ConfigError`` naming ``<prefix>.<field>`` and the value."""
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not meta:
            continue
        value = get_key(node, f.name)
        if value is None:
            continue
        if "choices" in meta:
            ok = value in tuple(meta["choices"])
        else:
            ok = (
                ("gt" not in meta or value > meta["gt"])
                and ("ge" not in meta or value >= meta["ge"])
                and ("lt" not in meta or value < meta["lt"])
                and ("le" not in meta or value <= meta["le"])
            )
        if not ok:
            what = "choose " + describe_check(meta) if "choices" in meta else "must be " + describe_check(meta)
            hint = f" ({meta['hint']})" if "hint" in meta else ""
            key = f"{prefix}.{f.name}" if prefix else f.name
            raise ConfigError(f"{key}={value!r}: {what}{hint}")


def as_dataclass(cfg: Any, cls: type, key_prefix: str):
    """``cfg`` as a ``cls`` dataclass: None (defaults), a ``cls``, a dict or a DictConfig.

    An unknown key fails here, naming it (Hydra's structured configs fail earlier, at composition).
    """
    if isinstance(cfg, cls):
        return cfg
    if cfg is None:
        return cls()
    if isinstance(cfg, DictConfig):
        obj = OmegaConf.to_object(cfg)
        if isinstance(obj, cls):
            return obj
        cfg = obj
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{key_prefix}: expected a mapping of {cls.__name__} keys, got {type(cfg).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(cfg) - names)
    if unknown:
        raise ConfigError(f"{key_prefix}.{unknown[0]}: unknown key; {cls.__name__} has {sorted(names)}")
    return cls(**dict(cfg))


def check_types(node: Any, cls: type, prefix: str = "") -> None:
    """Check that each field of dataclass ``cls`` present in ``node`` (a DictConfig or a dict)
    holds a value of its annotated type: ``int`` (not a bool, not ``96.5``), ``float`` (an int is
    fine), ``str``, ``bool``, a list, each optionally ``None``. For a node Hydra cannot type at
    composition (``env``, whose other keys are a class's constructor arguments), so that
    ``env.max_turns=abc`` fails here in one line naming the key, not later in a comparison or
    after the model loads."""
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        value = get_key(node, f.name)
        if value is None or f.name.startswith("_"):
            continue
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = type(None) in args
        base = next((a for a in args if a is not type(None)), hint) if args and optional else hint
        base = typing.get_origin(base) or base
        if base is int:
            ok, what = isinstance(value, int) and not isinstance(value, bool), "an integer"
        elif base is float:
            ok, what = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        elif base is bool:
            ok, what = isinstance(value, bool), "true or false"
        elif base is str:
            ok, what = isinstance(value, str), "a string"
        elif base in (list, tuple, typing.List):
            ok, what = isinstance(value, (list, tuple)) or OmegaConf.is_list(value), "a list"
        else:
            continue
        if not ok:
            key = f"{prefix}.{f.name}" if prefix else f.name
            null = " or null" if optional else ""
            raise ConfigError(f"{key}={value!r}: must be {what}{null}")
