"""Resources from the environment, checked when the definitions load.

Every field of a resource built here has a variable, ``<PREFIX><FIELD>`` in upper case
(``AERIE_CAPTURE_BACKEND`` for ``capture.backend``); a field of a section (a nested
``Config``) has ``<PREFIX><SECTION>_<FIELD>`` (``AERIE_CAPTURE_HF_DTYPE`` for
``capture.hf.dtype``). A deployment sets the variables on the
code server and the run workers; each run (sensor, schedule, UI, ``dagster job execute``)
gets the resource so configured, and run config (``resources: <name>: config:``) still
overrides field by field.

- Secrets (``secrets=``) become ``EnvVar``s: Dagster resolves them in the run worker, so
  they never enter run config, the event log, metadata or storage.
- Every other value is parsed by the field's type (``int``, ``float``, ``bool``, a list as
  JSON or comma-separated, a ``Literal`` choice) and validated by the resource's
  constraints now: a bad value stops the code location from loading, with an error that
  names the variable and the field, instead of failing a run half-way. Checks that need a
  secret's value or a server (a storage root, URLs to reach) run when a run starts.
"""

import json
import os
import types
import typing
from typing import Any, Literal, TypeVar

from dagster import Config, ConfigurableResource, EnvVar
from pydantic import ValidationError
from pydantic.fields import FieldInfo

R = TypeVar("R", bound=ConfigurableResource)


class EnvConfigError(ValueError):
    """A variable whose value its resource field cannot take."""


def leaf_fields(cls: type[Config]) -> dict[str, FieldInfo]:
    """Every field of ``cls``, a section's (a nested ``Config``) as ``section.field``."""
    fields: dict[str, FieldInfo] = {}
    for name, info in cls.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, Config):
            fields.update({f"{name}.{inner}": sub
                           for inner, sub in leaf_fields(info.annotation).items()})
        else:
            fields[name] = info
    return fields


def env_names(cls: type[ConfigurableResource], prefix: str,
              names: dict[str, str] | None = None) -> dict[str, str]:
    """Field → variable, for every field of ``cls`` (a section's as ``section.field``;
    ``names`` overrides the rule; without a prefix every field must be named)."""
    names = names or {}
    fields = leaf_fields(cls)
    unnamed = [f for f in fields if f not in names]
    if not prefix and unnamed:
        raise TypeError(f"{cls.__name__}: fields {unnamed} have no variable")
    return {f: names.get(f, f"{prefix}{f.replace('.', '_').upper()}") for f in fields}


def resource_from_env(cls: type[R], prefix: str, *, secrets: tuple[str, ...] = (),
                      names: dict[str, str] | None = None,
                      environ: typing.Mapping[str, str] | None = None,
                      outside_dagster: bool = False) -> R:
    """``cls`` with the fields whose variables are set (see the module doc).
    ``outside_dagster`` (the ``aerie`` command, which builds resources itself): secrets are
    read as values, since nothing resolves an ``EnvVar`` there."""
    environ = os.environ if environ is None else environ
    variables = env_names(cls, prefix, names)
    fields = leaf_fields(cls)
    values: dict[str, Any] = {}
    for name, var in variables.items():
        if var not in environ:
            continue
        if name in secrets and not outside_dagster:
            value: Any = EnvVar(var)
        elif name in secrets:
            value = environ[var]
        else:
            value = parse_value(environ[var], fields[name].annotation,
                                f"{var} ({cls.__name__}.{name})")
        *sections, leaf = name.split(".")
        target = values
        for section in sections:
            target = target.setdefault(section, {})
        target[leaf] = value
    try:
        return cls(**values)
    except ValidationError as e:
        problems = "; ".join(_problem(cls, variables, err) for err in e.errors())
        raise EnvConfigError(problems) from None


def _problem(cls: type, variables: dict[str, str], err: Any) -> str:
    if not err["loc"]:  # a check of several fields together
        return f"{cls.__name__}: {err['msg']}"
    parts = [str(part) for part in err["loc"]]  # (section, field, list index, ...)
    paths = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
    field = next((p for p in paths if p in variables), paths[0])  # the field that has one
    return f"{variables.get(field, field)} ({cls.__name__}.{field}): {err['msg']}"


def parse_value(text: str, annotation: Any, where: str) -> Any:
    """``text`` as a value of ``annotation``; :class:`EnvConfigError` naming ``where``."""
    kind, optional = _unwrap_optional(annotation)
    if optional and text.strip() == "":
        return None
    origin = typing.get_origin(kind)
    try:
        if kind is bool:
            return _boolean(text)
        if kind in (int, float):
            return kind(text.strip())
        if origin is list:
            (item,) = typing.get_args(kind) or (str,)
            return [parse_value(str(v), item, where) for v in _items(text)]
        if origin is Literal:
            choices = typing.get_args(kind)
            value = type(choices[0])(text.strip())
            if value not in choices:
                raise ValueError(f"not one of {list(choices)}")
            return value
    except (ValueError, TypeError) as e:
        raise EnvConfigError(f"{where}: {text!r} is not a valid value: {e}") from None
    return text


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return (args[0] if len(args) == 1 else annotation), True
    return annotation, False


def _items(text: str) -> list[Any]:
    """A JSON list, or comma-separated values."""
    stripped = text.strip()
    if stripped.startswith("["):
        value = json.loads(stripped)
        if not isinstance(value, list):
            raise ValueError("expected a JSON list")
        return value
    return [part.strip() for part in stripped.split(",") if part.strip()]


def _boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")
