"""How one setting of a recipe is declared: `setting(...)`, a dataclass field that carries its
documentation, its check, how a resume treats it and its command-line form.

Every setting of `pretrain` and `sft` is one such field of a group in recipes/settings.py. What
reads a setting reads the field's `Meta`: the recipe's checks (`check_fields`), the configuration
a saved state must match and what to tell the user when it differs (`recorded_keys`, the hints),
the CLI's flags and TOML keys (tokenloom/cli_config.py) and the settings ``inspect`` prints.
Adding a setting is one field (plus its use, and the recipe's keyword that fills it).

Resume, per setting (`Meta.resume`):

- `MATCH`: the batches depend on it; a resume with another value is refused, naming the setting,
  the two values and ``hint``;
- `TOPOLOGY`: positions are per rank and worker; an elastic resume may change it;
- `FREE`: the batches do not depend on it (``why`` says so), so it is not recorded.

A setting is recorded under its own name, or under ``record`` where several settings make one
recorded value (the mix's strategy, unit and stop rule are one line, so a state saved before
the settings were split still loads). A setting added later declares ``absent``, the value a state
saved before it stands for: it is recorded only where it differs, so those states still load.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

MATCH, TOPOLOGY, FREE = "match", "topology", "free"
RECIPES = ("pretrain", "sft")


@dataclass(frozen=True)
class Cli:
    """A setting's command-line form. ``key``: the TOML key and flag (``--key`` with ``-`` for ``_``;
    default: the keyword); ``type``: parses a flag's word (``bool``: ``--key/--no-key``); ``path``:
    relative to the TOML file when it comes from one; ``per_source``: one value, or name=value per
    source; ``many``: several words (``--pattern a b a``)."""

    key: Optional[str] = None
    type: Callable[[str], Any] = str
    choices: Optional[Tuple[str, ...]] = None
    path: bool = False
    per_source: bool = False
    many: bool = False


@dataclass(frozen=True)
class Meta:
    """What a setting declares besides its default (see the module docstring)."""

    doc: str
    check: Optional[Callable[[str, Any], Any]]
    resume: str
    hint: str
    record: Optional[str]
    follows: Tuple[str, ...]
    follows_when_absent: bool
    absent: Any
    cli: Optional[Cli]
    no_cli: str
    keyword: Dict[str, str]


def setting(default: Any = dataclasses.MISSING, *, doc: str, check: Optional[Callable[[str, Any], Any]] = None,
            resume: str = MATCH, hint: str = "", why: str = "", record: Optional[str] = None,
            follows: Tuple[str, ...] = (), follows_when_absent: bool = False, absent: Any = dataclasses.MISSING,
            cli: Optional[Cli] = Cli(), no_cli: str = "",
            keyword: Optional[Dict[str, str]] = None) -> Any:
    """A settings field. ``doc``: what it means; ``check(name, value) -> value``: validates and
    normalizes, raising with the bad value and the fix; ``resume``/``hint``/``why``/``record``: see
    the module docstring (a `MATCH` setting recorded under its own name needs a ``hint``, a `FREE`
    one a ``why``); ``follows``: the settings whose change changes this one's derived value (a resume
    names them as the cause); ``cli``: its flag, or None with ``no_cli`` saying why it has none;
    ``keyword``: the recipe keyword where it differs from the field's name, per recipe."""
    if resume not in (MATCH, TOPOLOGY, FREE):
        raise ValueError(f"{resume=} is not one of {(MATCH, TOPOLOGY, FREE)}")
    if resume == FREE and not why:
        raise ValueError("a FREE setting says why the batches do not depend on it (why=)")
    if cli is None and not no_cli:
        raise ValueError("a setting without a command-line flag says why (no_cli=)")
    meta = Meta(doc=doc, check=check, resume=resume, hint=hint or why, record=record, follows=tuple(follows),
                follows_when_absent=follows_when_absent, absent=absent, cli=cli, no_cli=no_cli, keyword=dict(keyword or {}))
    return dataclasses.field(default=default, metadata={"setting": meta})


def meta_of(field: dataclasses.Field) -> Meta:
    return field.metadata["setting"]


def settings_fields(group: Any) -> Iterator[Tuple[str, dataclasses.Field]]:
    """``(name, field)`` of every setting of a group class or instance, in declaration order."""
    for f in dataclasses.fields(group):
        if "setting" in f.metadata:
            yield f.name, f


def keyword_of(name: str, meta: Meta, recipe: str) -> str:
    """The recipe's keyword for a setting (sft's ``messages_field`` fills ``text_column``)."""
    return meta.keyword.get(recipe, name)


def check_fields(group: Any) -> Dict[str, Any]:
    """Each field's value after its check: ``{name: value}`` to `dataclasses.replace` the group with."""
    out = {}
    for name, f in settings_fields(group):
        check = meta_of(f).check
        if check is not None:
            out[name] = check(name, getattr(group, name))
    return out


def recorded_keys(group: Any) -> Dict[str, Tuple[str, ...]]:
    """``{recorded key: (the settings recorded under it)}`` for a group's `MATCH` and `TOPOLOGY` settings."""
    out: Dict[str, Tuple[str, ...]] = {}
    for name, f in settings_fields(group):
        meta = meta_of(f)
        if meta.resume != FREE:
            key = meta.record or name
            out[key] = out.get(key, ()) + (name,)
    return out


def hints_of(*groups: Any) -> Dict[str, str]:
    """What to tell the user, per recorded key of the groups' `MATCH` settings, when a saved state differs."""
    out: Dict[str, str] = {}
    for group in groups:
        for name, f in settings_fields(group):
            meta = meta_of(f)
            if meta.resume == MATCH and meta.hint:
                out.setdefault(meta.record or name, meta.hint)
    return out


def config_of(groups: Tuple[Any, ...], resolved: Dict[str, Any]) -> Dict[str, Any]:
    """The configuration a saved state must match: per recorded key of the groups' settings, the
    value ``resolved`` gives (what the recipe resolved: fingerprints, token ids, a record several
    settings make), else the setting's own value. A setting with ``absent`` is left out while its
    value is that or None (as states saved before it record it). ``resolved`` must give every key
    several settings, or a setting of another name, are recorded under; its other keys are added."""
    out: Dict[str, Any] = {}
    left_out = set()
    for group in groups:
        for key, names in recorded_keys(group).items():
            if key in resolved:
                value = resolved[key]
            elif len(names) > 1 or names[0] != key:
                raise KeyError(f"the configuration key {key!r} records settings {names}: the recipe resolves its value")
            else:
                value = getattr(group, key)
            absent = meta_of(next(f for n, f in settings_fields(group) if n == names[0])).absent
            if absent is not dataclasses.MISSING and value in (absent, None):
                left_out.add(key)
                continue
            out[key] = value
    for key, value in resolved.items():
        if key not in left_out:
            out.setdefault(key, value)
    return out
