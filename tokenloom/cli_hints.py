"""Error messages in the words of the command line: ``seq_len=0`` becomes ``--seq-len 0``.

The recipes and nodes word their errors for Python callers (``pass text_column= ...``,
``on_error='skip'``, ``f"{seq_len=} must be >= 1"``). A person at the terminal has
flags, so `for_cli` rewrites each ``name=`` whose keyword has a flag (`FLAG_OF`, built
from the shared settings table, so a new setting is covered the day it is added) and,
for a keyword the command line has no flag for (`NO_FLAG`), leaves it and says so
once at the end. Any other ``x=`` is left alone: it is a value (``bos=0``), a source
name or an example, not advice. Text inside quotes (a repr of a saved setting such as
``'interleave unit=tokens stop=never'``) is never touched.
Trade-off: it is wording, matched on the shapes the messages use (``name=`` after a
non-word character); a message that names a keyword another way is passed as is.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

from .cli_config import SETTINGS, no_flag_settings

#: Keyword -> flag: every setting (by its recipe keyword, or its own name), plus the keywords of nodes and load_state_dict that a setting feeds.
FLAG_OF: Dict[str, str] = {
    **{s.kwarg or s.key: s.flag for s in SETTINGS},
    "weights": "--weights",
    "strategy": "--mix",                 # Mix(strategy=) is fed by --mix
    "long": "--long-conversations",      # RenderChat(long=)
    "allow_weight_change": "--allow-weight-change",
}

#: Keywords of the Python API that no command-line flag sets: the recipes' settings without one
#: (recipes/settings.py says why), and the readers' and the loader's own.
NO_FLAG = tuple(dict.fromkeys(
    [*no_flag_settings(), "on_error", "on_null", "require_type", "field", "padding_batch", "device", "errors",
     "fmt", "endpoint_override", "scheme", "prefetch_factor", "persistent_workers", "pin_memory",
     "snapshot_every_n_steps"]))

# Whole phrases first: where a word-for-word rewrite would not read as advice for a flag.
_PHRASES = (
    ("allow_weight_change=True to load_state_dict", "--allow-weight-change"),
    ("pass sources={name: spec, ...}", "give the sources as name=path arguments"),
    ("sources={name: spec}", "name=path arguments"),
    ("per source as {name: value}", "per source as name=value"),          # check_config's "text"
    ("or {source name: value} for each", "or name=value for each source"),  # check_args.per_source
    ("the sft recipe, sft(...)", "the sft recipe, --recipe sft"),           # sources.files.sft_advice
    # check_config's world_size and num_workers (an old run of one rank is one file: --elastic)
    ("pass load_state_dict the list of every old rank's state, [state, ...], to continue on this topology "
     "(elastic resume)", "pass every old rank's state file to --resume (elastic resume) to continue on this topology"),
    ("pass load_state_dict the list of every old rank's state, [state, ...], to continue with these workers "
     "(elastic resume)", "pass every old rank's state file to --resume (elastic resume; one file: add --elastic) "
     "to continue with these workers"),
)
_QUOTED = re.compile(r"(?<![\w])'[^'\n]*'(?![\w])|(?<![\w])\"[^\"\n]*\"(?![\w])")
_KEYWORD = re.compile(r"(?<![\w.\-])([a-z_][a-z0-9_]*)=(?!=)")
_SAME = re.compile(r"\bthe same ([a-z_]+)\b")  # check_config's "pass the same num_workers"


def for_cli(message: str, recipe: Optional[str] = None) -> str:
    """``message`` with flags for keywords (see the module docstring). ``recipe`` picks the
    column flag where a message names the readers' generic ``field=``."""
    column = "--messages-field" if recipe == "sft" else "--text-column"
    for old, new in (("field= (text_column= in recipes)", column),
                     ("field= (in recipes: text_column= for pretrain, messages_field= for sft)", column), *_PHRASES):
        message = message.replace(old, new)
    missing: List[str] = []

    def keyword(m: re.Match) -> str:
        # At the end of an unquoted stretch the next character is a quote, so a value follows.
        name, after = m.group(1), m.string[m.end():m.end() + 1] or quote_next
        if name in FLAG_OF:
            # "pass text_column= with" -> "pass --text-column with"; "seq_len=0" -> "--seq-len 0".
            return FLAG_OF[name] + ("" if after == "" or after.isspace() or after in ",;:.)" else " ")
        if name in NO_FLAG and name not in missing:
            missing.append(name)
        return m.group(0)

    def same(m: re.Match) -> str:
        return f"the same {FLAG_OF[m.group(1)]}" if m.group(1) in FLAG_OF else m.group(0)

    def unquoted(text: str) -> str:
        return _SAME.sub(same, _KEYWORD.sub(keyword, text))

    out, last, quote_next = [], 0, "'"
    for q in _QUOTED.finditer(message):
        out += [unquoted(message[last:q.start()]), q.group(0)]
        last = q.end()
    quote_next = ""
    out.append(unquoted(message[last:]))
    text = "".join(out)
    if missing:
        names = ", ".join(f"{n}=" for n in missing)
        text += f" ({names} {'is a Python API keyword' if len(missing) == 1 else 'are Python API keywords'} " \
                "with no command-line flag)"
    return text
