"""Typed keys: a schema is a dataclass, the one declaration of its keys: the annotation gives each key's type, the
field its default, and the field metadata its range (a Rule), its one-line doc and whether it may change on resume.
check_fields checks a plain mapping against a schema strictly: OmegaConf's own merge would turn 'yes' into true, 1
into true and '3' into 3, which would hide typos, so the types are checked here instead (and the nodes registered
with Hydra, store.py, are the defaults as plain values, not typed nodes)."""

from __future__ import annotations

import math
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Callable, Mapping

from dit_train.config.errors import ConfigError, invalid


@dataclass(frozen=True)
class Rule:
    valid: str  # what is valid, in the words of the error message
    ok: Callable[[Any], bool] = lambda v: True


def key(valid: str | None = None, ok: Callable[[Any], bool] | None = None, default=MISSING, doc: str = "",
        resume: bool = False, recorded_before=MISSING, placement: bool = False):
    """A schema field: `valid` describes the accepted values, `ok` tests a value of the right type; `default`
    (none: the key is required), `doc` its one line in --help, `resume` true when a resumed run may change it
    (cadence, paths, logging: what does not change the maths); `recorded_before`, for a key added after runs were
    recorded, the value that reproduces what they did (a checkpoint whose config lacks the key resumes under it);
    `placement` true for an optimizer key that only the sharded implementation takes (a keyword of
    ShardedMatrixOptimizer; optim/registry.py passes exactly these)."""
    meta = {"rule": Rule(valid, ok or (lambda v: True))} if valid else {}
    meta.update(doc=doc, resume=resume, placement=placement)
    if recorded_before is not MISSING:
        meta["recorded_before"] = recorded_before
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def choice(*options, valid: str | None = None, **declared):
    return key(valid or f"choose one of {', '.join(map(str, options))}", lambda v: v in options, **declared)


def int_at_least(n: int, **declared):
    return key(f"expected an integer >= {n}", lambda v: v >= n, **declared)


def number(valid: str, ok: Callable[[float], bool], **declared):
    return key(valid, ok, **declared)


def default_of(f):
    """A field's default (MISSING for a required key)."""
    return f.default_factory() if f.default_factory is not MISSING else f.default


def defaults(schema) -> dict:
    """The schema's keys with their defaults, nested schemas as nested dicts, '???' for a required key: the node
    registered with Hydra (store.py) and what library calls with a partial config fill in."""
    hints = typing.get_type_hints(schema)
    out = {}
    for f in fields(schema):
        if is_dataclass(hints[f.name]):
            out[f.name] = defaults(hints[f.name])
        else:
            value = default_of(f)
            out[f.name] = "???" if value is MISSING else value
    return out


def walk(schema, prefix: str = ""):
    """(dotted key, field, type) of every key of `schema`, nested schemas expanded."""
    hints = typing.get_type_hints(schema)
    for f in fields(schema):
        path = f"{prefix}{f.name}"
        if is_dataclass(hints[f.name]):
            yield from walk(hints[f.name], path + ".")
        else:
            yield path, f, hints[f.name]


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def type_ok(tp, v) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin is typing.Union:
        return any(type_ok(a, v) for a in args)
    if tp is type(None):
        return v is None
    if tp is bool:
        return isinstance(v, bool)
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if tp is float:
        return _is_number(v)
    if tp is str:
        return isinstance(v, str)
    if origin in (list, tuple):
        if not isinstance(v, (list, tuple)):
            return False
        if origin is tuple and Ellipsis not in args:
            return len(v) == len(args) and all(type_ok(a, x) for a, x in zip(args, v))
        return all(type_ok(args[0], x) for x in v)
    if origin is dict:
        return isinstance(v, Mapping)
    raise TypeError(f"schema type {tp!r} is not supported by check_fields")


def _type_text(tp) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return "null or " + _type_text(inner[0]).removeprefix("expected ")
    return {int: "expected an integer", float: "expected a number", bool: "expected true or false",
            str: "expected a string"}.get(tp, f"expected {getattr(tp, '__name__', tp)}")


def accepted(f, tp) -> str:
    """What the schema field `f` of type `tp` accepts, in the words of its error message."""
    rule = f.metadata.get("rule")
    return rule.valid if rule else _type_text(tp)


def _key_path(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def check_fields(prefix: str, schema, values: Mapping, what: str | None = None) -> dict:
    """The values of `values` checked against the dataclass `schema`: no unknown key, no missing key (a field
    without a default is required), each value of its annotated type and inside its Rule. Returns a plain dict
    (nested schemas as nested dicts). Keys are reported as `prefix.key` (as `key` where prefix is "": the run
    config's own keys, `seed=abc`, as they are typed)."""
    hints = typing.get_type_hints(schema)
    names = [f.name for f in fields(schema)]
    for k, v in values.items():
        if k not in names:
            raise invalid(_key_path(prefix, k), v,
                          f"not a key of {what or prefix}; valid keys: {', '.join(sorted(names))}")
    out = {}
    for f in fields(schema):
        path, tp = _key_path(prefix, f.name), hints[f.name]
        rule = f.metadata.get("rule")
        valid = accepted(f, tp)
        if f.name not in values:
            if default_of(f) is MISSING and not is_dataclass(tp):
                raise ConfigError(f"{path} is missing: {valid}")
            if is_dataclass(tp):
                out[f.name] = check_fields(path, tp, {})
            else:
                out[f.name] = default_of(f)
            continue
        value = values[f.name]
        if value == "???":
            raise invalid(path, value, f"a value is required ({valid})")
        if is_dataclass(tp):
            if not isinstance(value, Mapping):
                raise invalid(path, value, f"expected a mapping with keys {', '.join(x.name for x in fields(tp))}")
            out[f.name] = check_fields(path, tp, value)
            continue
        if not type_ok(tp, value) or (value is not None and rule is not None and not rule.ok(value)):
            raise invalid(path, value, valid)
        out[f.name] = value
    return out
