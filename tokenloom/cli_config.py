"""Loader settings from command-line flags and a TOML file, shared by ``run`` and ``inspect``.

``inspect`` must show the very batches ``run`` trains on, so both read one table
of settings (`SETTINGS`) and build the loader in one place (`build_loader`).
Precedence: the recipe's own defaults < the TOML file (``--config``) < flags.
Settings not given are not passed, so the recipe's own defaults apply and the
command line never disagrees with the Python API; values are validated by the
recipe, which names the bad value and the fix.

Sources are ``name=path`` (several names mix; the same name twice adds files to
that source) or plain paths (one source). In the TOML file, relative paths are
relative to the file, so a config can sit next to its data::

    recipe = "pretrain"
    tokenizer = "tokenizer.json"
    seq_len = 2048
    steps = 1000
    [sources]
    web = "web/*.parquet"
    code = ["code/a.parquet", "code/b.parquet"]
    [weights]
    web = 0.7
    code = 0.3
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from tokenloom.pipes.chat import TEMPLATE_NAMES
from tokenloom.pipes.tokenizer import DEMO_TOKENIZER
from tokenloom.recipes.setting import RECIPES, meta_of, settings_fields

BOTH = RECIPES
# "name=" at the start of a source: an identifier-like name, so paths and URIs
# (which hold "/" or ":" before any "=") stay paths.
_NAMED = re.compile(r"^([A-Za-z_][A-Za-z0-9_.-]*)=(.+)$")
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True)
class Setting:
    key: str                     # TOML key; the flag is --key with "-" for "_"
    kwarg: Optional[str]         # the recipe's keyword; None: used by the command itself
    type: Callable[[str], Any]
    help: str
    recipes: Tuple[str, ...] = BOTH
    choices: Optional[Tuple[str, ...]] = None
    path: bool = False           # a path: relative to the TOML file when it comes from one
    per_source: bool = False     # one value for every source, or name=value per source (a TOML table)
    many: bool = False           # several names: a,b,a on the command line, a list in the TOML file

    def metavar(self) -> Optional[str]:
        if self.per_source:
            word = self.key.split("_")[-1].upper()
            return f"{word}|NAME={word}"
        if self.choices:
            return None
        if self.many:
            return "NAME,NAME,..."
        return "PATH" if self.path else "N" if self.type is int else self.key.split("_")[-1].upper()

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


def _names(value: str) -> List[str]:
    """``a,b,a`` -> ``["a", "b", "a"]``."""
    return [v for v in value.split(",") if v]


def recipe_settings() -> Tuple[Setting, ...]:
    """A flag per setting of the recipes that has a command-line form (recipes/settings.py), in the
    order the recipes list them; a setting both recipes take is one flag."""
    from tokenloom.recipes.settings import PackedSpec

    found: Dict[str, Setting] = {}
    for recipe in RECIPES:
        for keyword, (attr, name) in PackedSpec.keywords(recipe).items():
            meta = meta_of(dict(settings_fields(PackedSpec.groups(recipe)[attr]))[name])
            cli = meta.cli
            if cli is None:
                continue
            key = cli.key or keyword
            if key in found:
                seen = found[key]
                doc = seen.help if meta.doc == seen.help else f"{seen.help}; {recipe}: {meta.doc}"
                found[key] = dataclasses.replace(seen, recipes=seen.recipes + (recipe,), help=doc)
                continue
            found[key] = Setting(key, keyword, _names if cli.many else cli.type, meta.doc, recipes=(recipe,),
                                 choices=cli.choices, path=cli.path, per_source=cli.per_source, many=cli.many)
    return tuple(found.values())


def no_flag_settings() -> List[str]:
    """The recipes' keywords for settings with no command-line form (sources and weights have
    their own arguments)."""
    from tokenloom.recipes.settings import PackedSpec

    out = []
    for recipe in RECIPES:
        for keyword, (attr, name) in PackedSpec.keywords(recipe).items():
            meta = meta_of(dict(settings_fields(PackedSpec.groups(recipe)[attr]))[name])
            if meta.cli is None and keyword not in ("sources", "weights") and keyword not in out:
                out.append(keyword)
    return out


SETTINGS: Tuple[Setting, ...] = (
    Setting("recipe", None, str, "what to build (default: pretrain)", choices=RECIPES),
    *recipe_settings(),
    Setting("steps", None, int, "batches to take (default: 100, or to the end with --epochs)"),
)
BY_KEY = {s.key: s for s in SETTINGS}
TABLES = ("sources", "weights")
DEFAULT_STEPS = 100


class Refused(argparse.Action):
    """A flag a command does not use: refused with ``why`` rather than accepted and ignored
    (hidden from --help; takes an optional value so ``--steps 5`` is one mistake, not two)."""

    def __init__(self, option_strings, dest, why: str = "", **kwargs):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} {self.why}")


def add_loader_arguments(parser: argparse.ArgumentParser, *, refuse: Optional[Mapping[str, str]] = None) -> None:
    """The sources, ``--config`` and every `SETTINGS` flag. Defaults are suppressed so
    that only flags actually given override the TOML file. ``refuse`` maps setting keys
    the command does not use to why (the TOML file, shared with ``run``, may still hold them)."""
    parser.add_argument("sources", nargs="*", default=argparse.SUPPRESS, metavar="SOURCE",
                        help="name=path or path (file, glob, directory, URI); several names are mixed")
    parser.add_argument("--config", metavar="TOML", help="read settings from a TOML file; flags override it")
    parser.add_argument("--weights", nargs="+", default=argparse.SUPPRESS, metavar="NAME=W",
                        help="weight per named source, e.g. --weights code=0.7 prose=0.3")
    for s in SETTINGS:
        if refuse and s.key in refuse:
            parser.add_argument(s.flag, action=Refused, why=refuse[s.key])
            continue
        only = "" if s.recipes == BOTH else f" [{'/'.join(s.recipes)} only]"
        default = _recipe_default(s)
        shown = f" (default: {default})" if default is not None and "default:" not in s.help else ""
        if s.type is bool:  # --flag / --no-flag
            parser.add_argument(s.flag, dest=s.key, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=s.help + shown + only)
            continue
        if s.per_source:  # a value, or name=value per source (the recipe checks the values)
            add_per_source_argument(parser, s.flag, s.key, s.metavar(), s.help + shown + only)
            continue
        parser.add_argument(s.flag, dest=s.key, type=s.type, choices=s.choices, default=argparse.SUPPRESS,
                            metavar=s.metavar(), help=s.help + shown + only)


class PerSource(argparse.Action):
    """A flag that takes one value for every source (``--text-column story``) or ``name=value``
    per source (``--text-column stories=story web=text``). It takes the words it needs and hands
    the rest back to the sources, so ``--text-column story data/`` still reads ``data/`` as a
    source: one plain word, or the ``name=value`` words of names not seen yet whose value is not a
    path (a name again, plain words and ``name=dir/`` are sources, as in ``--text-column
    stories=story web=text stories=tinystories/ web=web/``)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs="+", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        take: List[str] = []
        rest: List[str] = []
        if not _NAMED.match(values[0]):
            take, rest = values[:1], values[1:]
        else:
            names = set()
            for v in values:
                m = _NAMED.match(v)
                if m and m.group(1) not in names and not _path_like(m.group(2)):
                    names.add(m.group(1))
                    take.append(v)
                else:
                    rest.append(v)
        setattr(namespace, self.dest, take)
        if rest:
            namespace.sources = list(getattr(namespace, "sources", None) or []) + rest


def _path_like(value: str) -> bool:
    return "/" in value or os.sep in value or "*" in value or _URI.match(value) is not None or os.path.exists(value)


def add_per_source_argument(parser: argparse.ArgumentParser, flag: str, key: str, metavar: str, help: str) -> None:
    """A flag that takes one value for every source or ``name=value`` per source (`PerSource`,
    `parse_per_source`)."""
    parser.add_argument(flag, dest=key, action=PerSource, default=argparse.SUPPRESS, metavar=metavar, help=help)


def parse_per_source(flag: str, value: Any) -> Any:
    """A per-source setting as the recipe takes it: one value for every source, or ``{name: value}``.
    ``value`` is what the flag collected (a list of words: ``["story"]`` or ``["stories=story",
    "web=text"]``) or what the TOML file holds (a string, or a table of them)."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, str):
        return value
    named: Dict[str, str] = {}
    plain: List[str] = []
    for item in value:  # a name at most once (`PerSource` hands repeats back to the sources)
        m = _NAMED.match(item)
        if m:
            named[m.group(1)] = m.group(2)
        else:
            plain.append(item)
    if plain and (named or len(plain) > 1):
        raise ValueError(f"{flag} {' '.join(value)}: give one value for every source ({flag} {plain[0]}), or "
                         f"name=value for each source (e.g. {flag} stories=story web=text)")
    return plain[0] if plain else named


def _recipe_default(s: Setting) -> Any:
    """The recipe's default for ``s``, read from its signature (for --help only: a flag
    not given is not passed, so the recipe applies its own default)."""
    from tokenloom.recipes import pretrain, sft

    if s.kwarg is None:
        return None
    fn = pretrain if s.recipes[0] == "pretrain" else sft
    default = inspect.signature(fn).parameters[s.kwarg].default
    return None if default is inspect.Parameter.empty else default  # required (tokenizer): no default to show


def parse_sources(items: List[str]) -> Any:
    """Command-line sources to a recipe spec: a path, a list of paths, or {name: path | [paths]}."""
    named: Dict[str, List[str]] = {}
    plain: List[str] = []
    for item in items:
        m = _NAMED.match(item)
        if m and not os.path.exists(item):  # a file really called "a=b" stays a path
            named.setdefault(m.group(1), []).append(m.group(2))
        else:
            plain.append(item)
    if named and plain:
        raise ValueError(f"sources mix named and unnamed entries (unnamed: {plain[0]!r}); "
                         "name all of them (name=path) or none")
    if named:
        return {name: paths[0] if len(paths) == 1 else paths for name, paths in named.items()}
    return plain[0] if len(plain) == 1 else plain


def parse_weights(items: List[str]) -> Dict[str, float]:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            if not name:
                raise ValueError
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"--weights {item!r}: expected name=weight, e.g. code=0.7") from None
    return out


def read_toml(path: str) -> Dict[str, Any]:
    """The settings in a TOML file, keys checked and relative paths resolved against the file's folder."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ValueError("--config needs Python 3.11+ or the tomli package (pip install tomli)") from None
    if not os.path.isfile(path):
        raise ValueError(f"--config {path!r}: no such file; give the path of a TOML file")
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"--config {path!r}: not valid TOML: {e}") from None
    base = os.path.dirname(os.path.abspath(path))
    out: Dict[str, Any] = {}
    for raw, value in data.items():
        key = raw.replace("-", "_")
        if key not in BY_KEY and key not in TABLES:
            raise ValueError(f"--config {path!r}: unknown setting {raw!r}; known: {', '.join([*BY_KEY, *TABLES])}")
        setting = BY_KEY.get(key)
        if setting is not None and setting.type is int and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"--config {path!r}: {raw} = {value!r} must be an integer")
        if setting is not None and setting.type is bool and not isinstance(value, bool):
            raise ValueError(f"--config {path!r}: {raw} = {value!r} must be true or false")
        if setting is not None and setting.many and not (
                isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ValueError(f"--config {path!r}: {raw} = {value!r} must be a list of names, e.g. [\"a\", \"b\"]")
        if setting is not None and setting.path and isinstance(value, str):
            value = _relative_to(base, value)
        elif setting is not None and setting.path and isinstance(value, Mapping):
            value = {k: _relative_to(base, v) if isinstance(v, str) else v for k, v in value.items()}
        if setting is not None and setting.per_source and not (
                isinstance(value, str) or isinstance(value, Mapping) and all(isinstance(v, str) for v in value.values())):
            raise ValueError(f"--config {path!r}: {raw} = {value!r} must be a string, or a table of one string per "
                             f"source ([{raw}] then name = \"...\")")
        if key == "sources":
            value = _toml_sources(path, base, value)
        out[key] = value
    return out


def _relative_to(base: str, path: str) -> str:
    """A path relative to the TOML file's folder; names (demo, chatml, a tiktoken encoding) stay names."""
    if _URI.match(path) or os.path.isabs(path) or path in (DEMO_TOKENIZER, *TEMPLATE_NAMES):
        return path
    joined = os.path.join(base, path)
    if not os.path.exists(joined) and "/" not in path and "." not in path:  # "cl100k_base"
        return path
    return joined


def _toml_sources(path: str, base: str, value: Any) -> Any:
    def one(spec: Any) -> Any:
        if isinstance(spec, str):
            return _relative_to(base, spec)
        if isinstance(spec, list) and all(isinstance(s, str) for s in spec):
            return [_relative_to(base, s) for s in spec]
        raise ValueError(f"--config {path!r}: sources entry {spec!r} must be a path or a list of paths")

    if isinstance(value, Mapping):
        return {name: one(spec) for name, spec in value.items()}
    return one(value)


def merged_settings(args: argparse.Namespace) -> Dict[str, Any]:
    """TOML file values, overridden by the flags given; sources and weights parsed."""
    out: Dict[str, Any] = read_toml(args.config) if getattr(args, "config", None) else {}
    given = vars(args)
    for key in BY_KEY:
        if key in given:
            out[key] = given[key]
    for s in SETTINGS:
        if s.per_source and s.key in out:
            out[s.key] = parse_per_source(s.flag, out[s.key])
    if given.get("sources"):
        out["sources"] = parse_sources(given["sources"])
    if given.get("weights"):
        out["weights"] = parse_weights(given["weights"])
    return out


def recipe_kwargs(settings: Mapping[str, Any]) -> Tuple[str, Callable[..., Any], Dict[str, Any]]:
    """(recipe name, recipe function, keyword arguments) for `build_loader`."""
    from tokenloom.recipes import pretrain, sft

    recipe = settings.get("recipe", "pretrain")
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} is not one of {RECIPES}")
    if "sources" not in settings:
        raise ValueError("no sources: give name=path or path arguments, or [sources] in a --config file")
    fn = pretrain if recipe == "pretrain" else sft
    kwargs: Dict[str, Any] = {}
    for s in SETTINGS:
        if s.key not in settings or s.kwarg is None or s.key == "tokenizer":
            continue
        if recipe not in s.recipes:
            value = settings[s.key]
            given = (s.flag if value else "--no-" + s.flag[2:]) if s.type is bool else f"{s.flag} {value!r}"
            raise ValueError(f"{given} applies to recipe {'/'.join(s.recipes)}, "
                             f"this is recipe={recipe!r}; remove it or pass --recipe {s.recipes[0]}")
        kwargs[s.kwarg] = settings[s.key]
    if "weights" in settings:
        kwargs["weights"] = settings["weights"]
    kwargs["tokenizer"] = tokenizer_path(settings)
    return recipe, fn, kwargs


def tokenizer_path(settings: Mapping[str, Any]) -> str:
    """--tokenizer, as `load_encoder` takes it (``demo`` names the shipped demo tokenizer there)."""
    value = settings.get("tokenizer")
    if not value:
        raise ValueError(f"no tokenizer: pass --tokenizer PATH to your tokenizer.json (or --tokenizer {DEMO_TOKENIZER} "
                         "for the shipped 4096-id demo tokenizer, for trying tokenloom out)")
    return value


def steps_to_take(settings: Mapping[str, Any]) -> Optional[int]:
    """--steps, else 100 for an endless stream, else None (to the end of --epochs)."""
    steps = settings.get("steps")
    if steps is not None and steps < 1:
        raise ValueError(f"--steps {steps} must be >= 1")
    if steps is None and settings.get("epochs") is None:
        return DEFAULT_STEPS
    return steps


def build_loader(settings: Mapping[str, Any], **overrides: Any):
    """(recipe name, loader) from merged settings; ``overrides``: keywords of the recipe that win over
    them (``tokenloom verify``'s other topologies: ``rank``, ``world_size``, ``num_workers``, ``rank_sync``)."""
    recipe, fn, kwargs = recipe_kwargs(settings)
    return recipe, fn(settings["sources"], **{**kwargs, **overrides})


def describe(recipe: str, loader: Any) -> str:
    """One line from the loader's own configuration, so it shows what was actually built."""
    c = loader.config
    sources = ", ".join(c["sources"])
    weights = ""
    if c.get("weights"):
        first = c["weights"][0][1]
        weights = " weights " + " ".join(f"{n}={w:.2f}" for n, w in first.items())
        if len(c["weights"]) > 1:
            weights += f" (schedule of {len(c['weights'])})"
    return (f"{recipe}: sources {sources}{weights}; seq_len={c['seq_len']} batch_size={c['batch_size']} "
            f"workers={c['num_workers']} packing={c['packing']} seed={c['seed']} epochs={c['epochs']}")


def settings_lines(spec: Any) -> List[str]:
    """Every setting the loader was built with (its spec, validated), a line per group: what
    ``inspect --settings`` prints. Keywords as the recipe takes them."""
    from tokenloom.recipes.setting import keyword_of

    lines: Dict[str, List[str]] = {}
    for attr, name, meta, value in spec.items():
        shown = getattr(value, "fingerprint", None) or value  # a loaded tokenizer: its fingerprint
        lines.setdefault(attr, []).append(f"{keyword_of(name, meta, spec.recipe)}={shown!r}")
    return [f"  {attr}: " + " ".join(words) for attr, words in lines.items()]
