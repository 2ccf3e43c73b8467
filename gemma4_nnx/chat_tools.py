"""Gemma 4 function calling: tool declarations, calls and results in the model's own format, the
parser that reads calls back, and the grammar that forces a call (`tool_choice`).

Where each rule comes from:

* The text of declarations, calls and results is what Google's `dialog` library (1.1.0, the
  conversation formatter Google's gemma library uses for Gemma 4; `dialog/_src/tool_helper.py`)
  writes: `<|tool>declaration:NAME{...}<tool|>`, `<|tool_call>call:NAME{...}<tool_call|>`,
  `<|tool_response>response:NAME{...}<tool_response|>`, where a value is written with unquoted
  object keys, `,` between items, no spaces, strings between `<|"|>` tokens, `true` / `false` /
  `null`, and floats with an integral value as integers. A declaration's body is the tool's
  definition without its name (`description`, `parameters`, `response`), every object's keys sorted
  alphabetically, and in schemas `type` upper-cased and `$schema` dropped.
* Placement: declarations are chunks of the system turn (after the system text); a model turn holds
  its text then its calls; the results of those calls are chunks of the *same* model turn (the
  `dialog` library merges consecutive model turns), which stays open after the last result so the
  model continues its answer (transformers' Gemma 4 response parser starts a response after
  `<tool_response|>` for the same reason). The model ends its calls with `<|tool_response>`, one of
  the checkpoint's stop tokens (`generation_config.json`: `<eos>`, `<turn|>`, `<|tool_response>`).
* Parsing: transformers' Gemma 4 response template (`transformers/cli/serving/utils.py`): calls are
  `<|tool_call>call:(\\w+)` ... `<tool_call|>`, repeated, with JSON-like content whose keys are
  unquoted and whose strings are delimited by `<|"|>`; text outside calls is the content. Real
  models also write neighbours of that shape (an unclosed call, `call:name(key="v")`, JSON bodies,
  several calls in one opener; `ToolCallParser` lists them and the issues that reported them are in
  `tests/test_chat_tools.py`): those are read as calls too, and anything else is left as content.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "QUOTE",
    "TOOL_CALL",
    "ToolCallError",
    "ToolCallParser",
    "call_grammar",
    "declaration",
    "gemma_value",
    "parse_tool_calls",
    "tool_call_text",
    "tool_response_text",
]

QUOTE = '<|"|>'
TOOL, END_TOOL = "<|tool>", "<tool|>"
TOOL_CALL, END_TOOL_CALL = "<|tool_call>", "<tool_call|>"
TOOL_RESPONSE, END_TOOL_RESPONSE = "<|tool_response>", "<tool_response|>"
SPECIAL_TOKENS = (TOOL, END_TOOL, TOOL_CALL, END_TOOL_CALL, TOOL_RESPONSE, END_TOOL_RESPONSE, QUOTE)


class ToolCallError(ValueError):
    """A tool, call or result that cannot be written in Gemma's format, or text that is not a call."""


# ------------------------------------------------------------------------------------------- writing
def gemma_value(value: Any) -> str:
    """A JSON value in Gemma's tool syntax (see the module docstring)."""
    if isinstance(value, str):
        return f"{QUOTE}{value}{QUOTE}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{gemma_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(gemma_value(v) for v in value) + "]"
    raise ToolCallError(f"cannot write a {type(value).__name__} in a tool call or result")


def _sorted(value):
    if isinstance(value, Mapping):
        return {k: _sorted(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def _schema(schema: Any) -> Any:
    """`dialog`'s schema normalization: `type` upper-cased (also in lists), `$schema` dropped, and the
    same below properties / items / allOf / anyOf / oneOf / not."""
    if not isinstance(schema, Mapping):
        raise ToolCallError(f"a JSON schema must be an object, got {type(schema).__name__}")
    out = dict(schema)
    out.pop("$schema", None)
    if "type" in out:
        t = out["type"]
        out["type"] = [x.upper() for x in t] if isinstance(t, list) else str(t).upper()
    if "properties" in out:
        out["properties"] = {k: _schema(v) for k, v in out["properties"].items()}
    for key in ("items", "not"):
        if key in out:
            out[key] = _schema(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [_schema(v) for v in out[key]]
    return out


def declaration(function: Mapping[str, Any]) -> str:
    """`<|tool>declaration:NAME{...}<tool|>` of an OpenAI function definition ({name, description,
    parameters})."""
    name = function.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"\w+", name):
        raise ToolCallError(f"a function name must be letters, digits and underscores, got {name!r}")
    body = {k: v for k, v in function.items() if k not in ("name", "strict")}
    if "parameters" in body:
        body["parameters"] = _schema(body["parameters"])
    return f"{TOOL}declaration:{name}{gemma_value(_sorted(body))}{END_TOOL}"


def tool_call_text(name: str, arguments: Mapping[str, Any]) -> str:
    return f"{TOOL_CALL}call:{name}{gemma_value(dict(arguments))}{END_TOOL_CALL}"


def tool_response_text(name: str, response: Mapping[str, Any]) -> str:
    return f"{TOOL_RESPONSE}response:{name}{gemma_value(dict(response))}{END_TOOL_RESPONSE}"


# ------------------------------------------------------------------------------------------- reading
#: Openers of a call: Gemma's token, and the spelling with a second `|` some checkpoints drift to.
OPENERS = (TOOL_CALL, "<|tool_call|>")
#: Markers that end a call's arguments: brackets the model left open there are closed for it.
_ENDS = (END_TOOL_CALL, TOOL_RESPONSE)
_NAME = re.compile(r"[A-Za-z_][\w.:-]*")
_BARE_KEY = re.compile(r"[A-Za-z_$][\w.$-]*")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_STRINGS = {'"': re.compile(r'"(?:[^"\\]|\\.)*"', re.S), "'": re.compile(r"'(?:[^'\\]|\\.)*'", re.S)}
_BARE = re.compile(r"[^,}\])<]*")
_LITERALS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


class _NeedMore(Exception):
    """The text ends before the parse can decide (a stream waits for more). `until`: a character
    that must come before anything changes (the end of an open string), or None."""

    def __init__(self, until: str | None = None):
        self.until = until


class _Reader:
    """Recursive descent over Gemma's call syntax and its sloppy neighbours, from `s[i]` on. `final`:
    the text is complete (its end is an end, not a pause); otherwise reaching it raises `_NeedMore`,
    so a decision taken on a prefix holds for every continuation."""

    MAX_DEPTH = 64  # nested objects / arrays: deeper is not a call (and would exhaust Python's stack)

    def __init__(self, s: str, i: int, final: bool):
        self.s, self.i, self.final, self.depth = s, i, final, 0

    def nested(self, close: str, item, out):
        self.depth += 1
        if self.depth > self.MAX_DEPTH:
            raise ToolCallError(f"arguments nested deeper than {self.MAX_DEPTH} at character {self.i} of a tool call")
        try:
            return self.items(close, item, out)
        finally:
            self.depth -= 1

    def more(self, until: str | None = None):
        if self.final:
            raise ToolCallError("the text ends inside a tool call")
        raise _NeedMore(until)

    def fail(self, what: str):
        if self.i >= len(self.s):
            self.more()
        raise ToolCallError(f"{what} at character {self.i} of a tool call")

    def ws(self) -> None:
        """Skip whitespace; the text must go on."""
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1
        if self.i == len(self.s):
            self.more()

    def at(self, word: str, consume: bool = True) -> bool:
        rest = self.s[self.i : self.i + len(word)]
        if rest == word:
            self.i += len(word) if consume else 0
            return True
        if not self.final and self.i + len(rest) == len(self.s) and word.startswith(rest):
            raise _NeedMore
        return False

    def at_end(self) -> bool:
        """At a marker that ends the call (not consumed)."""
        return any(self.at(m, consume=False) for m in _ENDS)

    def call(self) -> tuple[str, dict]:
        """`call:NAME{...}`, `call:NAME(...)` with `:` or `=` between names and values, `call:NAME({...})`,
        or `call:NAME` right before the closer (no arguments)."""
        self.ws()
        if not self.at("call:"):
            self.at(":")  # openers seen without `call` (vLLM #54778)
        m = _NAME.match(self.s, self.i)
        if not m:
            self.fail("expected a function name")
        if m.end() == len(self.s):
            self.more()
        name, self.i = m.group(), m.end()
        self.ws()
        if self.at("{"):
            return name, self.items("}", self.member, {})
        if self.at("("):
            self.ws()
            if not self.at("{", consume=False):
                return name, self.items(")", self.member, {})
            args = self.value()
            self.ws()
            if not (self.at(")") or self.at_end()):
                self.fail("expected ')'")
            return name, args
        if self.at_end():
            return name, {}
        self.fail("expected '{' or '(' after the function name")

    def items(self, close: str, item, out):
        """Items up to `close` (a trailing comma allowed), or up to an end marker if `close` is missing."""
        self.ws()
        if self.at(close):
            return out
        while True:
            item(out)
            self.ws()
            comma = self.at(",")
            if comma:
                self.ws()
            if self.at(close) or self.at_end():
                return out
            if not comma:
                self.fail(f"expected ',' or {close!r}")

    def member(self, out: dict) -> None:
        self.ws()
        if self.s[self.i] in "'\"" or self.at(QUOTE, consume=False):
            key = self.value()
        else:
            m = _BARE_KEY.match(self.s, self.i)
            if not m:
                self.fail("expected a key")
            if m.end() == len(self.s):
                self.more()
            key, self.i = m.group(), m.end()
        self.ws()
        if not (self.at(":") or self.at("=")):
            self.fail("expected ':' or '=' after a key")
        out[key] = self.value()

    def value(self):
        self.ws()
        s, i = self.s, self.i
        if self.at(QUOTE):
            j = s.find(QUOTE, self.i)
            if j < 0:
                self.more(QUOTE[-1])
            self.i = j + len(QUOTE)
            return s[i + len(QUOTE) : j]
        if s[i] in "'\"":
            return self.quoted(s[i])
        if self.at("{"):
            return self.nested("}", self.member, {})
        if self.at("["):
            return self.nested("]", lambda out: out.append(self.value()), [])
        return self.bare()

    def quoted(self, q: str):
        """A JSON ("...") or Python ('...') string literal."""
        m = _STRINGS[q].match(self.s, self.i)
        if not m:  # not terminated
            self.more(q)
        literal, self.i = m.group(), m.end()
        try:
            return json.loads(literal, strict=False) if q == '"' else ast.literal_eval(literal)
        except (ValueError, SyntaxError):
            self.fail(f"bad string literal {literal!r}")

    def bare(self):
        """An unquoted value up to `,`, a closing bracket or a marker: a number, true / false / null
        (or Python's True / False / None), else the text as a string."""
        j = _BARE.match(self.s, self.i).end()
        if j == len(self.s):
            self.more()
        token, self.i = self.s[self.i : j].strip(), j
        if not token:
            self.fail("expected a value")
        if token in _LITERALS:
            return _LITERALS[token]
        return json.loads(token) if _NUMBER.fullmatch(token) else token


def parse_arguments(body: str) -> dict:
    """A `{...}` in Gemma's syntax (or a tolerated neighbour of it) as a dict; ToolCallError otherwise."""
    r = _Reader(body.strip(), 0, final=True)
    value = r.value() if r.s.startswith("{") else r.fail("expected '{'")
    if r.i != len(r.s):
        r.fail("unexpected text after the arguments")
    return value


def _envelope(s: str, start: int, final: bool) -> tuple[list[tuple[str, dict, str]], int, int]:
    """The calls after the opener at `start`: ([(name, arguments, raw text)], where the envelope
    ends, where the text of a call that did not parse begins (-1: none)). The raw texts partition
    the envelope: the first from the opener, the last through the closer."""
    opener = next(o for o in OPENERS if s.startswith(o, start))
    r = _Reader(s, start + len(opener), final)
    calls, begin = [], start
    while True:
        try:
            name, args = r.call()
        except ToolCallError:
            return calls, begin, begin
        end = r.i
        more = False
        while r.i < len(s) and s[r.i].isspace():
            r.i += 1
        if r.i < len(s) or not final:
            if r.at(END_TOOL_CALL):
                end = r.i
            else:
                r.at(",") or r.at(";")
                while r.i < len(s) and s[r.i].isspace():
                    r.i += 1
                more = r.at("call:", consume=False)
        calls.append((name, args, s[begin:end]))
        if not more:
            return calls, end, -1
        begin = end


_SETTLING = frozenset("{}()[]<>\"'")


class ToolCallParser:
    """Splits a model's output into content and calls, incrementally (`feed` pieces, then `flush`):
    what a stream shows equals what `parse_tool_calls` returns for the whole text.

    Recovered: a call without its closer (at the end of the text, before other text or before the
    next opener), `call:NAME(key="v", n=3)` (Python keywords) and `call:NAME(key:<|"|>v<|"|>)`,
    `call:NAME({...})` behind a drifted `<|tool_call|>` opener, several calls in one opener (with or
    without `,` / `;` / newlines between), JSON bodies (`{"city": "Paris"}`), Python strings, bare
    words as strings, an opener without `call:`, brackets left open before the closer, and repeated
    closers after a call. `names` (the request's tools): a call to any other function is content.
    Whatever does not parse is content, verbatim: no call is dropped and no text swallowed. A call
    cut off inside its arguments at the end of the text (max_tokens) is content too."""

    def __init__(self, names=None):
        self.names = None if names is None else frozenset(names)
        self.buf = ""
        self.after_call = False  # right after a call: stray closers are dropped
        self.until = None  # inside an open string of a call: nothing changes before this character
        self.held = 0  # length of a held, undecided call at the last scan (0: none held)

    def feed(self, piece: str) -> tuple[str, list[tuple[str, dict]]]:
        self.buf += piece
        if self.until is not None and self.until not in piece:  # a long argument streams in linear time
            return "", []
        # A held call is decided by the whole text, so rescanning it later gives what rescanning it now
        # would: rescan when a piece may close something (brackets, quotes, a marker's `<` / `>`) or the
        # held text has doubled, which keeps long arguments (a 3,000-number array) linear, not quadratic.
        if self.held and len(self.buf) < 2 * self.held and not any(c in piece for c in _SETTLING):
            return "", []
        return self._scan(final=False)

    def flush(self) -> tuple[str, list[tuple[str, dict]]]:
        return self._scan(final=True)

    def _scan(self, final: bool) -> tuple[str, list[tuple[str, dict]]]:
        s, i, content, calls = self.buf, 0, [], []
        self.until, self.held = None, 0
        while i < len(s):
            if self.after_call:
                if s.startswith(END_TOOL_CALL, i):
                    i += len(END_TOOL_CALL)
                    continue
                if not final and END_TOOL_CALL.startswith(s[i:]):
                    break
                self.after_call = False
            j = min((k for k in (s.find(o, i) for o in OPENERS) if k >= 0), default=-1)
            if j < 0:
                keep = 0 if final else _marker_prefix(s, i)
                content.append(s[i : len(s) - keep])
                i = len(s) - keep
                break
            content.append(s[i:j])
            try:
                found, end, failed = _envelope(s, j, final)
            except _NeedMore as e:
                i, self.until = j, e.until
                self.held = len(s) - j
                break
            for name, args, raw in found:
                if self.names is None or name in self.names:
                    calls.append((name, args))
                else:  # OpenAI returns calls to declared tools only: the client sees what was written
                    content.append(raw)
            if failed < 0:
                i, self.after_call = end, bool(found)
            elif failed == j:  # the first call did not parse: its opener is text, and so is what follows
                content.append(s[j : j + next(len(o) for o in OPENERS if s.startswith(o, j))])
                i = j + len(content[-1])
            else:
                i = failed
        self.buf = s[i:]
        return "".join(content).replace(TOOL_RESPONSE, ""), calls


def _marker_prefix(s: str, i: int) -> int:
    """The length of the longest end of s[i:] that may begin an opener or `<|tool_response>` (held
    back: the next piece decides)."""
    for n in range(min(len(s) - i, len(TOOL_RESPONSE) - 1), 0, -1):
        if any(m.startswith(s[len(s) - n :]) for m in (*OPENERS, TOOL_RESPONSE)):
            return n
    return 0


def parse_tool_calls(text: str, names=None) -> tuple[str, list[tuple[str, dict]]]:
    """(content, [(name, arguments)]) of a model's whole output (`ToolCallParser`; a trailing
    `<|tool_response>` dropped). `names`: the declared functions (None: any)."""
    parser = ToolCallParser(names)
    content, calls = parser.feed(text)
    rest, more = parser.flush()
    return content + rest, calls + more


# ------------------------------------------------------------------------------------------- forcing a call
def _lark_string(s: str) -> str:
    return json.dumps(s)


def call_grammar(functions: Sequence[Mapping[str, Any]], token_id, *, parallel: bool = True) -> str:
    """A Lark grammar (llguidance) of one or more calls of these functions in Gemma's syntax, then
    `<|tool_response>`: each call's arguments follow that function's parameters schema (required
    properties in the schema's order; a schema part this writer does not cover accepts any value).
    token_id(text) -> the id of a special token. parallel=False: exactly one call."""
    t = {s: f"<[{token_id(s)}]>" for s in (TOOL_CALL, END_TOOL_CALL, TOOL_RESPONSE, QUOTE)}
    rules = [
        f"start: call{'+' if parallel else ''} {t[TOOL_RESPONSE]}",
        f"string: {t[QUOTE]} /[^\\x00]{{0,200}}/ {t[QUOTE]}",
        "number: /-?(0|[1-9][0-9]{0,15})(\\.[0-9]{1,15})?([eE][+-]?[0-9]{1,3})?/",
        "integer: /-?(0|[1-9][0-9]{0,15})/",
        'boolean: "true" | "false"',
        'null: "null"',
        "value: string | number | boolean | null | obj | arr",
        'obj: "{" (pair ("," pair)*)? "}"',
        'pair: /[A-Za-z_][A-Za-z0-9_]{0,40}/ ":" value',
        'arr: "[" (value ("," value)*)? "]"',
    ]
    counter = [0]

    def rule(schema) -> str:
        """The rule name for values of `schema`."""
        if not isinstance(schema, Mapping):
            return "value"
        if "enum" in schema:
            counter[0] += 1
            name = f"enum{counter[0]}"
            alts = [
                (f"{t[QUOTE]} {_lark_string(v)} {t[QUOTE]}" if isinstance(v, str) else _lark_string(gemma_value(v)))
                for v in schema["enum"]
            ]
            rules.append(f"{name}: " + " | ".join(alts))
            return name
        kind = schema.get("type")
        if kind == "string":
            return "string"
        if kind == "integer":
            return "integer"
        if kind == "number":
            return "number"
        if kind == "boolean":
            return "boolean"
        if kind == "null":
            return "null"
        if kind == "array":
            counter[0] += 1
            name, item = f"arr{counter[0]}", rule(schema.get("items"))
            rules.append(f'{name}: "[" ({item} ("," {item})*)? "]"')
            return name
        if kind == "object" and "properties" in schema:
            counter[0] += 1
            name = f"obj{counter[0]}"
            props = schema["properties"]
            keys = [k for k in props if k in set(schema.get("required", ()))]
            parts = [f'"{k}:" {rule(props[k])}' for k in keys if re.fullmatch(r"[A-Za-z_]\w*", k)]
            body = ' "," '.join(parts)
            rules.append(f'{name}: "{{" {body} "}}"' if parts else f'{name}: "{{" "}}"')
            return name
        return "value"

    alts = []
    for f in functions:
        args = rule(f.get("parameters") or {"type": "object", "properties": {}})
        alts.append(f'{t[TOOL_CALL]} "call:{f["name"]}" {args} {t[END_TOOL_CALL]}')
    rules.insert(1, "call: " + " | ".join(alts))
    return "\n".join(rules)
