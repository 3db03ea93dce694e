"""The settings objects' common part: :class:`SettingsBase` (params, as_dict, from_config, defaults, replace),
the builder from a config section and :func:`stage_value`."""

from __future__ import annotations

import dataclasses
from dataclasses import fields
from typing import Any, ClassVar

from ..config.schema import filled


def build_settings(cls, values: dict, **extra):
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names}, **extra)


class SettingsBase:
    """Common part of the stage settings: :meth:`params` (the content keys) and :meth:`as_dict`."""

    #: the fields a stage's output depends on: its rule's params
    CONTENT: ClassVar[tuple[str, ...]] = ()

    def params(self) -> dict:
        """The content keys and their values (the rule's params: a change reruns the stage)."""
        out = {}
        for k in self.CONTENT:
            v = getattr(self, k)
            out[k] = v.params() if isinstance(v, SettingsBase) else v
        return out

    def as_dict(self) -> dict:
        """Every field as a plain dict (nested settings as dicts too)."""
        return {
            f.name: (lambda v: v.as_dict() if isinstance(v, SettingsBase) else v)(getattr(self, f.name))
            for f in fields(self)
        }

    #: the config section a settings class is filled from as it is (``from_config`` / ``defaults`` below), if any
    SECTION: ClassVar[str | None] = None

    @classmethod
    def from_config(cls, config: dict):
        """The settings of ``config[SECTION]`` with the schema's defaults where unset."""
        return build_settings(cls, filled(cls.SECTION, config.get(cls.SECTION)))

    @classmethod
    def defaults(cls, **values):
        """The schema's defaults, updated by ``values``."""
        return build_settings(cls, filled(cls.SECTION, values))

    def replace(self, **changes):
        """A copy with ``changes`` (field name -> value)."""
        return dataclasses.replace(self, **changes)


def stage_value(config: dict, path: str) -> Any:
    """The value of dotted config key ``path`` (``"merge.threads"``), the schema's default where unset."""
    head, _, key = path.rpartition(".")
    tree: Any = config
    for part in head.split(".") if head else []:
        tree = (tree or {}).get(part)
    return filled(head, tree)[key]
