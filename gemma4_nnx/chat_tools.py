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
  unquoted and whose strings are delimited by `<|"|>`; text outside calls is the content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "QUOTE",
    "TOOL_CALL",
    "ToolCallError",
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
_CALL = re.compile(r"<\|tool_call>call:(\w+)(.*?)<tool_call\|>", re.S)
_KEY = re.compile(r"([A-Za-z_][\w\-.]*)\s*:")  # an unquoted object key


def _to_json(body: str) -> str:
    """Gemma's syntax -> JSON text: strings re-quoted with JSON escapes, bare keys quoted."""
    out, i = [], 0
    while i < len(body):
        if body.startswith(QUOTE, i):
            j = body.find(QUOTE, i + len(QUOTE))
            if j < 0:
                raise ToolCallError("an unterminated string in a tool call")
            out.append(json.dumps(body[i + len(QUOTE) : j]))
            i = j + len(QUOTE)
            continue
        m = _KEY.match(body, i)
        if m and (not out or out[-1].rstrip().endswith(("{", ","))):
            out.append(json.dumps(m.group(1)) + ":")
            i = m.end()
            continue
        out.append(body[i])
        i += 1
    return "".join(out)


def parse_arguments(body: str) -> dict:
    """The `{...}` of a call as a dict; ToolCallError if it is not an object in Gemma's syntax."""
    try:
        value = json.loads(_to_json(body.strip()))
    except json.JSONDecodeError as e:
        raise ToolCallError(f"tool call arguments are not valid: {e}") from None
    if not isinstance(value, dict):
        raise ToolCallError("tool call arguments must be an object")
    return value


def parse_tool_calls(text: str) -> tuple[str, list[tuple[str, dict]]]:
    """(content, [(name, arguments)]) of a model's output: the calls in it, parsed, and the text
    around them (a trailing `<|tool_response>` dropped). A call whose arguments do not parse raises
    ToolCallError."""
    calls = [(m.group(1), parse_arguments(m.group(2))) for m in _CALL.finditer(text)]
    content = _CALL.sub("", text)
    content = content.replace(TOOL_RESPONSE, "")
    return content, calls


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
