"""Hugging Face chat templates (Jinja2), rendered so data stays text and only answers are trained.

Rendering is transformers' (``apply_chat_template``): jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
loop controls, a ``tojson`` that does not escape HTML, ``raise_exception``, and the
variables ``messages``, ``bos_token``, ``eos_token``, ``add_generation_prompt``
(``tools`` and ``documents`` are None). There is no ``strftime_now``: a template
that prints today's date would render differently after a resume.

Data stays text. transformers encodes the rendered string with special tokens
allowed, so a message holding ``<|im_start|>`` becomes that control token. Here,
before rendering, every special-token spelling inside a message's strings has its
first character swapped for a Unicode private-use placeholder (same length, not
found in the conversation). Every special token in the rendered text was then
written by the template: the text is cut there, each becomes its id, and the text
between (placeholders put back) is encoded as data (`Encoder.encode_batch`, where
special spellings are text).

The mask. A template with ``{% generation %}...{% endgeneration %}`` blocks says
what is trained (transformers' ``return_assistant_tokens_mask``): an extension
wraps each block's output in two placeholders, found and removed after
rendering. Without blocks, prefix differences (torchtune's approach): for a
trained message i, messages[:i] rendered with ``add_generation_prompt=True`` must
be a prefix of messages[:i+1] rendered, itself a prefix of the whole
conversation; the characters between are trained (the answer and its end
marker, not the assistant header). A template that rewrites earlier turns (one
that drops past reasoning, say) is refused, showing where the renders diverge.
A probe conversation is rendered when the template is resolved, so a template
that cannot give a mask, or whose mask misses the answers, fails in the calling
process.

Trade-off: the text is also cut at the edges of trained spans, so no token
straddles prompt and answer (at inference the prompt is encoded and the answer
generated, so this matches what the model sees there); on the test conversations
the ids equal transformers' ``apply_chat_template(tokenize=True)`` for every one
(tests/test_chat_templates.py). Cost: one render per conversation with generation
blocks, 2k+1 for k answers without; rendering is cheap next to encoding the
pieces; a conversation costs about the same with or without generation blocks, and more
than with a `ChatTemplate`'s markers (figures in docs/performance.md).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .tokenizer import Encoder

#: The first private-use code point tried as a placeholder.
PRIVATE_USE = 0xE000
#: What `probe` renders: one of each role, two answers; a template may refuse the system role.
PROBE_ANSWERS = ("tokenloom probe answer one", "tokenloom probe answer two")
PROBE_PROMPTS = ("tokenloom probe system text", "tokenloom probe question one", "tokenloom probe question two")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatError(ValueError):
    pass


def special_pattern(encoder: Encoder) -> Tuple[Optional["re.Pattern[str]"], Dict[str, int]]:
    """A regex matching the tokenizer's special tokens (longest first), and their ids."""
    specials = encoder.special_tokens()
    if not specials:
        return None, specials
    return re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))), specials


def encode_markup(encoder: Encoder, texts: Sequence[str]) -> List[np.ndarray]:
    """Template text -> ids: the special tokens it spells become their ids, the rest is encoded
    as text (a ChatML marker ``<|im_start|>user\\n`` is 3 tokens where ``<|im_start|>`` is one, more
    where it is not)."""
    pattern, ids = special_pattern(encoder)
    plain: List[str] = []
    parts = [_pieces(text, (), None, plain, pattern, ids) for text in texts]
    encoded = encoder.encode_batch(plain) if plain else []
    return [_assemble(pieces, encoded)[0] if pieces else np.zeros(0, np.int32) for pieces in parts]


def _pieces(text: str, spans: Sequence[Tuple[int, int]], back: Optional[Dict[str, str]], plain: List[str],
            pattern: Optional["re.Pattern[str]"], ids: Dict[str, int]) -> List[Any]:
    """``text`` cut at the special tokens it spells and at the edges of the trained ``spans``:
    (piece, trained) where a piece is [special id] or the index of a text piece appended to
    ``plain`` (placeholders ``back`` put back), so a batch encodes every text piece at once."""
    cuts = sorted({0, len(text), *(p for s in spans for p in s)})
    restore = str.maketrans(back) if back else None
    out: List[Any] = []

    def trained(pos: int) -> bool:
        return any(a <= pos < b for a, b in spans)

    def add_text(a: int, b: int) -> None:
        for lo, hi in zip([a] + [c for c in cuts if a < c < b], [c for c in cuts if a < c < b] + [b]):
            if hi > lo:
                out.append((len(plain), trained(lo)))
                piece = text[lo:hi]
                plain.append(piece.translate(restore) if restore else piece)

    pos = 0
    for m in pattern.finditer(text) if pattern is not None else ():
        add_text(pos, m.start())
        out.append(([ids[m.group()]], trained(m.start())))
        pos = m.end()
    add_text(pos, len(text))
    return out


def _assemble(pieces: List[Any], encoded: List[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of `_pieces`' output, its text pieces encoded in ``encoded``."""
    ids = [encoded[p] if isinstance(p, int) else np.asarray(p, np.int32) for p, _ in pieces]
    return (np.concatenate(ids).astype(np.int32),
            np.concatenate([np.full(len(i), t, bool) for i, (_, t) in zip(ids, pieces)]))


def _compile(source: str):
    """(environment, template, generation extension) as transformers builds them."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}body{% endgeneration %}``: the body's output between two markers."""

        tags = {"generation"}
        marks = ("", "")

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_wrap"), [], [], body).set_lineno(lineno)

        def _wrap(self, caller):
            return self.marks[0] + caller() + self.marks[1]

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(source)
    return template, next(e for e in env.extensions.values() if isinstance(e, Generation))


class JinjaTemplate:
    """A Hugging Face chat template (Jinja2 source), with the BOS/EOS strings it may print.

    ``train_roles`` matter only without ``{% generation %}`` blocks (with them, the template
    says what is trained)."""

    def __init__(self, source: str, *, bos_token: Optional[str] = None, eos_token: Optional[str] = None,
                 train_roles: Sequence[str] = ("assistant",), name: str = "chat_template"):
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"chat template {name!r} is {source!r:.60}; expected Jinja2 source text")
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self.train_roles, self.name = tuple(train_roles), name

    def __repr__(self) -> str:
        digest = hashlib.sha256(self.source.encode("utf-8")).hexdigest()[:16]
        return (f"JinjaTemplate({self.name!r}, sha256={digest}, bos_token={self.bos_token!r}, "
                f"eos_token={self.eos_token!r}, train_roles={self.train_roles!r})")

    @property
    def has_generation_blocks(self) -> bool:
        return bool(GENERATION_TAG.search(self.source))

    def resolve(self, encoder: Encoder) -> "JinjaRenderer":
        """Compile, and render the probe conversation: `ValueError` if the template cannot give a mask."""
        renderer = JinjaRenderer(self, encoder)
        renderer.probe()
        return renderer


def _strings(value: Any, out: List[str]) -> List[str]:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            _strings(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _strings(v, out)
    return out


def _map_strings(value: Any, fn) -> Any:
    """A plain copy of the message data (dicts, lists, scalars) with ``fn`` applied to every string."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(v, fn) for v in value]
    return value


def _free_chars(strings: Sequence[str], k: int) -> List[str]:
    """``k`` private-use characters none of ``strings`` holds."""
    out: List[str] = []
    code = PRIVATE_USE
    while len(out) < k:
        c = chr(code)
        if not any(c in s for s in strings):
            out.append(c)
        code += 1
        if code > 0xF8FF:
            raise ChatError("the conversation uses every private-use character; none is left as a placeholder")
    return out


class JinjaRenderer:
    """A `JinjaTemplate` bound to a tokenizer: conversations -> (ids, mask)."""

    def __init__(self, template: JinjaTemplate, encoder: Encoder):
        self.template, self.encoder = template, encoder
        try:
            self._jinja, self._gen = _compile(template.source)
        except Exception as e:
            raise ValueError(f"chat template {template.name!r} does not compile: {type(e).__name__}: {e}") from None
        self.generation = template.has_generation_blocks
        self._special, self._ids = special_pattern(encoder)
        self._firsts = sorted({t[0] for t in self._ids})
        self._vars = {k: v for k, v in (("bos_token", template.bos_token), ("eos_token", template.eos_token))
                      if v is not None}
        self.train = frozenset(template.train_roles)

    # --- text ---------------------------------------------------------------------------
    def _render(self, messages: List[Dict[str, Any]], add_generation_prompt: bool) -> str:
        return self._jinja.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                                  documents=None, **self._vars)

    def spans(self, messages: List[Dict[str, Any]], where: str) -> Tuple[str, List[Tuple[int, int]], Dict[str, str]]:
        """(rendered text with data specials defanged, trained character spans, placeholder -> character)."""
        chars = _free_chars(_strings(messages, []) + [self.template.source], len(self._firsts) + 2)
        swap = dict(zip(self._firsts, chars))
        back = {v: k for k, v in swap.items()}
        pattern = self._special
        if pattern is not None:
            messages = _map_strings(messages, lambda s: pattern.sub(lambda m: swap[m.group()[0]] + m.group()[1:], s))
        else:
            messages = _map_strings(messages, lambda s: s)
        name = self.template.name
        try:
            if self.generation:
                self._gen.marks = (chars[-2], chars[-1])
                try:
                    text = self._render(messages, False)
                finally:
                    self._gen.marks = ("", "")
                return (*self._generation_spans(text, chars[-2], chars[-1], where), back)
            text = self._render(messages, False)
            spans = []
            for i, m in enumerate(messages):
                if m["role"] not in self.train:
                    continue
                head = self._render(messages[:i], True)
                upto = self._render(messages[:i + 1], False) if i + 1 < len(messages) else text
                for a, b, what in ((upto, head, f"messages[:{i}] with add_generation_prompt=True"),
                                   (text, upto, f"messages[:{i + 1}]")):
                    if not a.startswith(b):
                        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                        raise ChatError(
                            f"{where}: chat template {name!r} cannot give a loss mask: {what} renders "
                            f"...{b[max(0, k - 30):k + 30]!r}, which is not a prefix of the longer conversation "
                            f"(...{a[max(0, k - 30):k + 30]!r}; the template changes earlier text as messages are "
                            "added). Use a template with {% generation %} blocks, or template='chatml'")
                if len(upto) > len(head):
                    spans.append((len(head), len(upto)))
            return text, spans, back
        except ChatError:
            raise
        except Exception as e:  # raise_exception() in the template, or a template bug
            raise ChatError(f"{where}: chat template {name!r} refused the conversation: {type(e).__name__}: {e}") from None

    @staticmethod
    def _generation_spans(text: str, open_: str, close: str, where: str) -> Tuple[str, List[Tuple[int, int]]]:
        out, spans, start = [], [], None
        pos = n = 0
        for m in re.finditer(f"[{re.escape(open_)}{re.escape(close)}]", text):
            out.append(text[pos:m.start()])
            n += m.start() - pos
            pos = m.end()
            if m.group() == open_:
                if start is not None:
                    raise ChatError(f"{where}: nested {{% generation %}} blocks")
                start = n
            else:
                if start is None:  # pragma: no cover - the extension always opens first
                    raise ChatError(f"{where}: {{% endgeneration %}} without {{% generation %}}")
                if n > start:
                    spans.append((start, n))
                start = None
        out.append(text[pos:])
        return "".join(out), spans

    # --- tokens ---------------------------------------------------------------------------
    def render_batch(self, convs: List[List[Dict[str, Any]]], wheres: List[str]
                     ) -> List[Optional[Tuple[np.ndarray, np.ndarray]]]:
        plain: List[str] = []
        parts = [None if not conv else _pieces(*self.spans(conv, where), plain, self._special, self._ids)
                 for conv, where in zip(convs, wheres)]
        encoded = self.encoder.encode_batch(plain) if plain else []
        return [_assemble(pieces, encoded) if pieces else None for pieces in parts]

    def probe(self) -> None:
        """Render a plain conversation (without the system turn if the template refuses one): its
        mask must hold both answers and no prompt, else `ValueError` with the reason."""
        system, q1, q2 = PROBE_PROMPTS
        turns = [{"role": "user", "content": q1}, {"role": "assistant", "content": PROBE_ANSWERS[0]},
                 {"role": "user", "content": q2}, {"role": "assistant", "content": PROBE_ANSWERS[1]}]
        name = self.template.name
        try:
            text, spans, _ = self.spans([{"role": "system", "content": system}] + turns, "probe")
        except ChatError as first:
            try:
                text, spans, _ = self.spans(turns, "probe")
            except ChatError:
                raise ValueError(f"{first}".replace("probe: ", "", 1)) from None
        trained = "".join(text[a:b] for a, b in spans)
        missing = [a for a in PROBE_ANSWERS if a not in trained]
        prompts = [p for p in PROBE_PROMPTS if p in trained]
        if missing or prompts or not spans:
            how = ("its {% generation %} blocks" if self.generation else
                   f"the prefix differences of {sorted(self.train)} messages")
            raise ValueError(f"chat template {name!r} cannot give a loss mask: on a probe conversation {how} "
                             f"train {trained[:160]!r}, which misses answers {missing} or holds prompts {prompts}. "
                             "Fix the template's blocks, or pass template='chatml'")
