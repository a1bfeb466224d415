"""The settings of `pretrain` and `sft`, written once, as a tree of frozen dataclasses.

`PackedSpec` holds one group per concern:

- `DataSettings`: what is read (the sources, the tokenizer, a listing index elsewhere);
- `TextSettings` (`pretrain`): how documents become ids (column, mode, BOS/EOS, labels, padding,
  a token cache); `ChatSettings` (`sft`): how conversations do (field, template, long ones);
- `MixSettings`: how sources are chosen (weights, strategy, unit, stop rule);
- `PackSettings`: how documents fill rows and batches;
- `RunSettings`: workers, seed, epochs, ranks.

Each field is a `setting` (recipes/setting.py): its doc, its check, whether a resume must match it
and what to tell the user, and its command-line form. The recipes' keywords fill the spec
(`PackedSpec.of`); `validate` runs the fields' checks and the rules between fields, in the calling
process, so a bad value fails before any worker starts. The configuration a saved state must
match is read from the fields (`config_of`), with the values the loader resolved (the files'
fingerprints, the tokenizer's, the special tokens' ids, the packer's defaults).

Example::

    spec = PackedSpec.of("pretrain", sources="data/", tokenizer="demo", seq_len=512)
    spec.pack.seq_len          # 512
    spec.mix.stop              # None: "never" once validated (epochs=None)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Tuple, Union

from tokenloom.pipes.chat import LONG_POLICIES, TEMPLATE_NAMES
from tokenloom.pipes.check_args import check_int
from tokenloom.pipes.engines import AUTO, ENGINES
from tokenloom.pipes.mix import STOPS, STRATEGIES, UNITS
from tokenloom.pipes.pack.bestfit import BestFitPack
from tokenloom.pipes.sources.readers import TEXT_MODES
from tokenloom.pipes.sources.retry import RetryPolicy
from tokenloom.pipes.tokenizer import DEMO_TOKENIZER

from .setting import FREE, TOPOLOGY, Cli, check_fields, hints_of, keyword_of, meta_of, setting, settings_fields
from .setting import config_of as record_config

PACKINGS = ("flat", "bestfit", "bestfit-crop")


def _token(value: str) -> Any:
    """A special token on the command line: an id if it is all digits, else a token string."""
    return int(value) if value.isdigit() else value


def at_least(minimum: int, none_means: str = ""):
    """A check: an int >= ``minimum`` (or None, where ``none_means`` says what None does)."""
    def check(name: str, value: Any) -> Any:
        return check_int(name, value, minimum, none_ok=bool(none_means), none_means=none_means)
    return check


def one_of(choices: Tuple[str, ...], none_ok: bool = False):
    """A check: one of ``choices`` (or None)."""
    def check(name: str, value: Any) -> Any:
        if value is None and none_ok:
            return None
        if value not in choices:
            raise ValueError(f"{name}={value!r} is not one of {choices}")
        return value
    return check


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")
    return value


def byte_size(text: str) -> Optional[int]:
    """A size on the command line: bytes, or with K, M or G (``64M``); ``none``: None."""
    t = text.strip().lower()
    if t == "none":
        return None
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t.rstrip("ib")[-1:], 1)
    digits = t.rstrip("ib")[:-1] if scale > 1 else t
    try:
        return int(float(digits) * scale)
    except ValueError:
        raise ValueError(f"{text!r} is not a size: write bytes, or e.g. 64M or 1G (or none)") from None


#: Decoded text a loader worker's readers hold at most, by default (`DataSettings.read_budget`).
READ_BUDGET = 64 << 20

SOURCES_HINT = "the files changed (names or sizes); resume on the same files, or start without the state"
ORDER_HINT = "the order of the sources decides the mix's ties and the sequence; pass them in the saved order"
TEXT_HINT = ("documents are read from this column (text files: split this way); pass the saved text_column= "
             "(sft: messages_field=) and text_mode=, per source as {name: value} where they differ")
TOKENIZER_HINT = "the tokenizer changed; resume with the same tokenizer, or start without the state"


@dataclass(frozen=True)
class DataSettings:
    """What is read."""

    sources: Any = setting(
        doc="name=path or path (file, glob, directory, URI, or a list of them); {name: spec} names several sources, "
            "which are mixed", hint=SOURCES_HINT, cli=None, no_cli="the SOURCE arguments (name=path or path)")
    tokenizer: Any = setting(
        doc=f"path to tokenizer.json or a tokenizer directory, a tiktoken encoding name, or {DEMO_TOKENIZER!r} for the "
            "shipped 4096-id demo tokenizer (required: a model trained on the wrong tokenizer is wasted)",
        hint=TOKENIZER_HINT, record="tokenizer", cli=Cli(path=True))
    engine: Optional[str] = setting(
        None, doc="what encodes a tokenizer.json: auto (the fastest engine that gives tokenizers' ids: fastokens, "
                  "tiktoken, tokenizers), or one of them forced (default: $TOKENLOOM_ENGINE, else auto)",
        check=one_of((AUTO,) + ENGINES, none_ok=True), resume=FREE,
        why="every engine gives tokenizers' ids, so the batches are the same", cli=Cli(choices=(AUTO,) + ENGINES))
    manifest: Any = setting(
        None, doc="path of a parquet index `tokenloom index --out` wrote away from the data ({name: path} with "
                  "several sources); an index in the directory a source resolves under is used without it",
        resume=FREE, why="the index lists the same files faster", cli=Cli(path=True, per_source=True))
    read_budget: Optional[int] = setting(
        READ_BUDGET, doc="bytes of decoded text one loader worker (or the training process) holds for reading, "
                         "shared by the sources: a parquet row group larger than its source's share (read_budget / "
                         "sources) is decoded in windows of that many bytes (at least 8 rows), its rows shuffled "
                         "within each window; a reader decodes the windows of its slice in one pass and holds those "
                         "it has yet to read lz4-compressed, up to twice its share, and decodes the group again for "
                         "the windows past that, so a larger budget costs memory and saves decodes; None: whole row "
                         "groups (memory then grows with sources x row group)",
        check=at_least(1, "whole row groups"), absent=None,
        hint="the row order inside row groups larger than read_budget / sources depends on it; pass the saved "
             "read_budget (None: whole row groups, what a state saved before this setting read)",
        cli=Cli(type=byte_size))
    retry: Optional[RetryPolicy] = setting(
        None, doc="how requests to https:// and hf:// sources are retried on what is transient (429, 5xx, a reset "
                  "or dropped connection, a timeout): a RetryPolicy(attempts=, max_time_s=, backoff_s=, "
                  "max_backoff_s=, timeout_s=); None: RetryPolicy()'s defaults (8 attempts within 60 s)",
        check=lambda name, value: _retry_policy(name, value), resume=FREE,
        why="retries change when bytes arrive, not which", cli=None,
        no_cli="Python only (RetryPolicy); the command line uses the defaults")


def _retry_policy(name: str, value: Any) -> Any:
    if value is not None and not isinstance(value, RetryPolicy):
        raise TypeError(f"{name}={value!r}: pass a tokenloom.recipes.RetryPolicy(...) (or None for the defaults)")
    return value


@dataclass(frozen=True)
class TextSettings:
    """`pretrain`: how documents become ids."""

    text_column: Any = setting(
        "text", doc="parquet column / jsonl field holding the text; name=column per source, e.g. --text-column "
                    "stories=story web=text", record="text", hint=TEXT_HINT, cli=Cli(per_source=True))
    text_mode: Any = setting(
        "file", doc=f"text files: one document per file or per paragraph ({' or '.join(TEXT_MODES)}; name=mode per "
                    "source)", record="text", cli=Cli(per_source=True, choices=TEXT_MODES))
    bos: Any = setting(None, doc="token string or id put before every document (default: the tokenizer's)",
                       record="tokenizer", cli=Cli(type=_token))
    eos: Any = setting(None, doc="token string or id put after every document (default: none)", record="tokenizer",
                       cli=Cli(type=_token))
    predict_bos: bool = setting(
        True, doc="label a document's last token with BOS (the model learns where documents end); False: -100 "
                  "there, nothing trained across documents", check=boolean,
        hint="pass the same predict_bos (it decides the labels at document ends)", cli=Cli(type=bool))
    pad: Any = setting(None, doc="token string or id of padding input_ids (default: the BOS id)",
                       hint="pass the same pad (padding ids are part of the batches)", cli=Cli(type=_token))
    cache: Any = setting(
        None, doc="token cache directory (path or URI) that `tokenloom tokenize --out` wrote, or {name: directory}: "
                  "ids instead of text, the same batches", resume=FREE,
        why="a token cache gives bitwise the same batches as the text", cli=Cli(path=True))
    cache_strict: bool = setting(
        False, doc="refuse a cache that lacks units, instead of tokenizing them on the fly", check=boolean,
        resume=FREE, why="the units a cache lacks are tokenized into the same ids", cli=Cli(type=bool))


@dataclass(frozen=True)
class ChatSettings:
    """`sft`: how conversations become ids and a loss mask."""

    text_column: Any = setting(
        "messages", doc="jsonl field / parquet column holding the conversation; name=field per source",
        record="text", hint=TEXT_HINT, cli=Cli(key="messages_field", per_source=True),
        keyword={"sft": "messages_field"})
    template: Any = setting(
        None, doc=f"chat template: {' or '.join(TEMPLATE_NAMES)}, a Jinja file, a tokenizer_config.json or a "
                  "tokenizer directory, a ChatTemplate or a callable (default: the tokenizer's own, else its role "
                  "tokens, else chatml)", record="chat", hint="pass the same template", cli=Cli(path=True))
    long_conversations: str = setting(
        "truncate", doc="conversations longer than a row", check=one_of(LONG_POLICIES), record="chat",
        cli=Cli(choices=LONG_POLICIES))
    bos: Any = setting(None, doc="token string or id that replaces the template's BOS", record="tokenizer",
                       cli=Cli(type=_token))
    pad: Any = setting(None, doc="token string or id of padding input_ids (default: 0)",
                       hint="pass the same pad (padding ids are part of the batches)", cli=Cli(type=_token))


@dataclass(frozen=True)
class MixSettings:
    """How several sources are chosen (one source: no mixer, not recorded)."""

    weights: Any = setting(
        None, doc="{name: weight}, or a schedule [(step, {name: weight}), ...] (default: equal)",
        hint="pass the same weights, or pass allow_weight_change=True to load_state_dict to switch mixtures at "
             "this point", cli=None, no_cli="--weights NAME=W ... (a TOML [weights] table)")
    mix: str = setting("interleave", doc="how sources are chosen", check=one_of(STRATEGIES), record="mix",
                       hint="pass the same mix settings (strategy, unit, stop rule, cycling, pattern, burst)",
                       cli=Cli(choices=STRATEGIES))
    weights_unit: str = setting("tokens", doc="weights count tokens or documents", check=one_of(UNITS), record="mix",
                                cli=Cli(choices=UNITS))
    stop: Optional[str] = setting(
        None, doc="when a finite mixture ends (needs epochs; default: all_exhausted with epochs, else never)",
        check=one_of(STOPS, none_ok=True), record="mix", cli=Cli(choices=STOPS))
    cycle_exhausted: bool = setting(True, doc="a source that ran out starts its next pass while others go on",
                                    check=boolean, record="mix", cli=Cli(type=bool))
    pattern: Optional[Sequence[str]] = setting(None, doc="mix='alternating': the names in the order they take turns",
                                               record="mix", cli=Cli(many=True))
    burst: int = setting(1, doc="mix='alternating': documents a source gives per turn", check=at_least(1),
                         record="mix", cli=Cli(type=int))


@dataclass(frozen=True)
class PackSettings:
    """How documents fill rows and batches."""

    seq_len: int = setting(2048, doc="tokens per row (T)", check=at_least(1),
                           hint="rows are packed for one sequence length; resume with the same seq_len",
                           cli=Cli(type=int))
    batch_size: int = setting(8, doc="rows per batch (B)", check=at_least(1),
                              hint="pass the same batch_size (positions count rows per batch)", cli=Cli(type=int))
    packing: str = setting("bestfit", doc="how documents fill rows", check=one_of(PACKINGS),
                           hint="pass the same packing mode", cli=Cli(choices=PACKINGS))
    buffer_size: int = setting(1000, doc="documents the best-fit packer looks at", check=at_least(1),
                               hint="pass the same buffer_size", follows=("packing",), follows_when_absent=True,
                               cli=Cli(type=int))
    buffer_tokens: Optional[int] = setting(
        None, doc="tokens the best-fit buffer holds at most (default: 16 rows' worth; bestfit-crop: half a row per "
                  "document of buffer_size); bounds what a resume re-reads",
        check=at_least(1, "the packer's default"), hint="pass the same buffer_tokens",
        follows=("seq_len", "packing", "buffer_size"), cli=Cli(type=int))
    max_wait: Optional[int] = setting(
        None, doc="pulls a buffered document may wait before it starts the next rows (default: buffer_size)",
        check=at_least(1, "buffer_size"), hint="pass the same max_wait (how long a buffered document may wait "
                                               "decides the rows)", follows=("buffer_size", "packing"),
        cli=Cli(type=int))
    min_fill: int = setting(
        1, doc="bestfit: the least gap at a row's end filled by cutting a long document; a smaller gap is padded "
               "(at most seq_len)", check=at_least(1), hint="pass the same min_fill (it decides where long documents "
                                                           "are cut)",
        follows=("packing",), follows_when_absent=True, absent=1, cli=Cli(type=int))
    piece_rows: int = setting(
        1, doc="pretrain, bestfit, several sources: a long document reaches the mixer in pieces of this many rows' "
               "worth of tokens (pipes/pieces.py); more rows cost the workers less per token with several sources "
               "and hold the shares less tightly (docs/performance.md, 'Many sources')",
        check=at_least(1), hint="pass the same piece_rows (it decides the order documents are mixed in)",
        follows=("packing",), follows_when_absent=True, absent=1, cli=Cli(type=int))

    def recorded(self) -> Dict[str, Any]:
        """The packer's settings as a resume compares them: its effective defaults, None where the
        packing mode does not use them."""
        if self.packing == "flat":
            return {"buffer_size": None, "max_wait": None, "buffer_tokens": None, "min_fill": None, "piece_rows": None}
        mode = "crop" if self.packing == "bestfit-crop" else "bestfit"
        return {"buffer_size": self.buffer_size, "min_fill": self.min_fill if mode == "bestfit" else None,
                "piece_rows": self.piece_rows if mode == "bestfit" else None,
                "max_wait": self.buffer_size if self.max_wait is None else self.max_wait,
                "buffer_tokens": BestFitPack.resolve_buffer_tokens(self.buffer_tokens, self.seq_len, mode,
                                                                   self.buffer_size)}


@dataclass(frozen=True)
class RunSettings:
    """Workers, seed, passes and ranks."""

    num_workers: int = setting(0, doc="loader worker processes (0: in this process)", check=at_least(0),
                               resume=TOPOLOGY, cli=Cli(key="workers", type=int))
    seed: int = setting(0, doc="shuffle seed", check=at_least(0), hint="pass the same seed", cli=Cli(type=int))
    epochs: Optional[int] = setting(None, doc="passes over the data, then stop (default: cycle forever)",
                                    check=at_least(1, "cycle forever"), hint="pass the same epochs", cli=Cli(type=int))
    rank: Optional[int] = setting(None, doc="this process's data rank (default: torch.distributed's, else 0)",
                                  resume=TOPOLOGY, cli=None, no_cli="read from torch.distributed")
    world_size: Optional[int] = setting(None, doc="data ranks (default: torch.distributed's, else 1)",
                                        resume=TOPOLOGY, cli=None, no_cli="read from torch.distributed")
    rank_sync: Any = setting(None, doc="keeps ranks in step at a finite epoch's end (default: over gloo when "
                                       "torch.distributed is initialized)", resume=FREE,
                             why="it only pads a rank whose data ended", cli=None, no_cli="an object")


GROUPS = {"data": DataSettings, "mix": MixSettings, "pack": PackSettings, "run": RunSettings}
TEXT_GROUPS = {"pretrain": TextSettings, "sft": ChatSettings}


@dataclass(frozen=True)
class PackedSpec:
    """Everything `pretrain` or `sft` is given, one group per concern (module docstring)."""

    recipe: str
    data: DataSettings
    text: Union[TextSettings, ChatSettings]
    mix: MixSettings
    pack: PackSettings
    run: RunSettings

    @classmethod
    def groups(cls, recipe: str) -> Dict[str, type]:
        """``{attribute: group class}`` of a recipe's spec, in the order its settings are listed."""
        return {"data": DataSettings, "text": TEXT_GROUPS[recipe], "mix": MixSettings, "pack": PackSettings,
                "run": RunSettings}

    @classmethod
    def keywords(cls, recipe: str) -> Dict[str, Tuple[str, str]]:
        """``{recipe keyword: (group attribute, field name)}`` for every setting of a recipe."""
        out = {}
        for attr, group in cls.groups(recipe).items():
            for name, f in settings_fields(group):
                out[keyword_of(name, meta_of(f), recipe)] = (attr, name)
        return out

    @classmethod
    def of(cls, recipe: str, **keywords: Any) -> "PackedSpec":
        """The spec a recipe's keywords fill (a keyword left out keeps its field's default)."""
        where = cls.keywords(recipe)
        unknown = sorted(set(keywords) - set(where))
        if unknown:
            raise TypeError(f"{recipe}() has no setting(s) {unknown}")
        values: Dict[str, Dict[str, Any]] = {attr: {} for attr in cls.groups(recipe)}
        for key, value in keywords.items():
            attr, name = where[key]
            values[attr][name] = value
        return cls(recipe, **{attr: group(**values[attr]) for attr, group in cls.groups(recipe).items()})

    def items(self) -> Iterator[Tuple[str, str, Any, Any]]:
        """``(group attribute, field name, Meta, value)`` of every setting, in order."""
        for attr in self.groups(self.recipe):
            group = getattr(self, attr)
            for name, f in settings_fields(group):
                yield attr, name, meta_of(f), getattr(group, name)

    def validate(self) -> "PackedSpec":
        """The spec with every field checked and normalized, and the rules between fields applied."""
        checked = {attr: dataclasses.replace(getattr(self, attr), **check_fields(getattr(self, attr)))
                   for attr in self.groups(self.recipe)}
        spec = dataclasses.replace(self, **checked)
        epochs, stop = spec.run.epochs, spec.mix.stop
        if stop is None:
            spec = dataclasses.replace(spec, mix=dataclasses.replace(
                spec.mix, stop="never" if epochs is None else "all_exhausted"))
        elif epochs is None and stop != "never":
            raise ValueError(f"{stop=} needs epochs=n (how many passes make a source exhausted)")
        if spec.pack.min_fill > spec.pack.seq_len:
            raise ValueError(f"min_fill={spec.pack.min_fill} must be <= seq_len={spec.pack.seq_len}: a row could never "
                             "be filled from a long document, only padded")
        if self.recipe == "sft" and spec.pack.packing == "bestfit-crop":
            raise ValueError("packing='bestfit-crop' would cut conversations to fill rows; use 'bestfit' (default)")
        return spec

    def hints(self) -> Dict[str, str]:
        """What to tell the user, per recorded key, when a saved state's value differs."""
        return {"source_order": ORDER_HINT, **hints_of(*(getattr(self, attr) for attr in self.groups(self.recipe)))}

    def follows(self) -> Dict[str, Tuple[Tuple[str, ...], bool]]:
        """Per recorded key, the settings whose change changes its value, and whether only to or from None."""
        return {name: (meta.follows, meta.follows_when_absent) for _, name, meta, _ in self.items() if meta.follows}

    def absent(self) -> Dict[str, Any]:
        """Per setting added after states were saved without it, the value such a state stands for."""
        return {name: meta.absent for _, name, meta, _ in self.items() if meta.absent is not dataclasses.MISSING}


def config_of(spec: PackedSpec, resolved: Mapping[str, Any]) -> Dict[str, Any]:
    """The configuration a saved state must match (`setting.config_of`): the values the loader
    resolved, the packer's effective ones, else the settings' own."""
    groups = tuple(getattr(spec, attr) for attr in spec.groups(spec.recipe))
    return record_config(groups, {**spec.pack.recorded(), **resolved})
