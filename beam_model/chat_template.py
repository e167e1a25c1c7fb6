"""Beam chat format: render OpenAI-style messages to a prompt, parse output back.

Turns look like `<|user|>TEXT<|end|>`; an assistant turn is
`<|assistant|><|think|>REASONING<|/think|>ANSWER<|end|>`, where ANSWER may be
followed by `<|tool_call|>{"name": ..., "arguments": {...}}<|/tool_call|>`
blocks. Client tools are listed in the system turn under `# Tools`.
`AssistantStreamParser` turns generated text deltas into reasoning / content /
tool-call events; `parse_assistant` is the same parser run on a whole text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

SYSTEM, USER, ASSISTANT, TOOL = "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"
THINK, END_THINK = "<|think|>", "<|/think|>"
TOOL_CALL, END_TOOL_CALL = "<|tool_call|>", "<|/tool_call|>"
END = "<|end|>"

# "developer" is the OpenAI API's name for system instructions to newer models (clients send either): the
# same system turn.
_ROLE_TOKENS = {"system": SYSTEM, "developer": SYSTEM, "user": USER, "tool": TOOL}


# ---------------------------------------------------------------- rendering

def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"{where}: content part {j} has unsupported type {kind!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{where}: content part {j} has no string 'text'")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where}: content must be a string, null or a list of parts, "
                     f"got {type(content).__name__}")


def _tools_section(tools: list) -> str:
    lines = []
    for k, tool in enumerate(tools):
        ok = isinstance(tool, dict) and tool.get("type") == "function"
        fn = tool.get("function") if ok else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{k}]: expected {{'type': 'function', "
                             "'function': {'name': ...}}")
        lines.append(json.dumps(fn, sort_keys=True, separators=(",", ":")))
    return "# Tools\n" + "\n".join(lines)


def _tool_call_block(call: Any, where: str) -> list[tuple[str, bool]]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}: expected {{'function': {{'name': ..., 'arguments': ...}}}}")
    args = fn.get("arguments")
    if args is None or args == "":
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: arguments are not valid JSON ({e})") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where}: arguments must be a JSON object")
    body = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
    return [(TOOL_CALL, True), (body, False), (END_TOOL_CALL, True)]


def chat_segments(messages: list[dict], tools: list[dict] | None = None,
                  add_generation_prompt: bool = True) -> list[tuple[str, bool]]:
    """OpenAI chat messages (and offered tools) as Beam prompt pieces (text, is_marker): markers are
    the template's special tokens; every other piece is client text, never to be read as a marker."""
    if not isinstance(messages, list):
        raise ValueError("messages must be a list")
    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools must be a list")
    tools_text = _tools_section(tools) if tools else None
    out = []
    for i, msg in enumerate(messages):
        where = f"message {i}"
        if not isinstance(msg, dict):
            raise ValueError(f"{where}: expected an object, got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or role not in (*_ROLE_TOKENS, "assistant"):
            raise ValueError(f"{where}: unknown role {role!r}")
        text = _text(msg.get("content"), where)
        if _ROLE_TOKENS.get(role) == SYSTEM and i == 0 and tools_text is not None:
            text = f"{text}\n\n{tools_text}" if text else tools_text
            tools_text = None
        if role in _ROLE_TOKENS:
            out += [(_ROLE_TOKENS[role], True), (text, False), (END, True)]
        else:  # assistant
            reasoning = msg.get("reasoning_content")
            if reasoning is None:
                reasoning = msg.get("reasoning")
            if reasoning is not None and not isinstance(reasoning, str):
                raise ValueError(f"{where}: reasoning must be a string")
            calls = msg.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ValueError(f"{where}: tool_calls must be a list")
            out += [(ASSISTANT, True), (THINK, True), (reasoning or "", False), (END_THINK, True), (text, False)]
            for j, c in enumerate(calls):
                out += _tool_call_block(c, f"{where} tool_calls[{j}]")
            out.append((END, True))
    if tools_text is not None:  # no leading system message to carry the tools
        out[:0] = [(SYSTEM, True), (tools_text, False), (END, True)]
    if add_generation_prompt:
        out.append((ASSISTANT, True))
    return [(t, marker) for t, marker in out if t]


def render_chat(messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True) -> str:
    """Render OpenAI chat messages (and offered tools) to a Beam prompt string."""
    return "".join(t for t, _ in chat_segments(messages, tools, add_generation_prompt))


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the prompt: markers as their special tokens, client text encoded as plain text,
    so a message that contains "<|end|>" cannot end its turn or forge another one."""
    ids: list[int] = []
    for text, marker in chat_segments(messages, tools, add_generation_prompt):
        ids += [tokenizer.token_to_id(text)] if marker else tokenizer.encode(text, allow_special=False)
    return ids



# The same rendering as a Jinja chat template, the form a Hugging Face checkpoint ships in
# tokenizer_config.json ("chat_template") and serving engines render. It is written for
# transformers' conventions (its `tojson(x, ensure_ascii=False, indent=None, separators=None,
# sort_keys=False)` filter, `raise_exception`); `render_chat_jinja` renders it with jinja2 under
# those conventions. It equals `render_chat` for every conversation `render_chat` accepts, except
# one: a tool call whose "arguments" arrive as a JSON string is copied verbatim (Jinja cannot parse
# JSON), where `render_chat` re-serializes it; the two agree when the string is in the form this
# project emits (`json.dumps(arguments, ensure_ascii=False)`). It validates less than
# `render_chat` does: the project encodes prompts with `encode_chat`, never with this template.
CHAT_TEMPLATE_JINJA = (
    "{%- macro text(c) -%}"
    "{%- if c is none or c is undefined -%}"
    "{%- elif c is string -%}{{ c }}"
    "{%- else -%}{%- for part in c -%}{{ part.text }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(tools='') -%}"
    "{%- if tools -%}"
    "{%- set ns.tools = '# Tools' -%}"
    "{%- for tool in tools -%}"
    "{%- set ns.tools = ns.tools ~ '\\n' ~ (tool.function | tojson(ensure_ascii=True, separators=(',', ':'),"
    " sort_keys=True)) -%}"
    "{%- endfor -%}"
    "{%- if messages[0].role != 'system' and messages[0].role != 'developer' -%}"
    "<|system|>{{ ns.tools }}<|end|>"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role in ('system', 'developer', 'user', 'tool') -%}"
    "<|{{ 'system' if message.role == 'developer' else message.role }}|>"
    "{%- set body = text(message.content) -%}"
    "{%- if loop.first and message.role in ('system', 'developer') and ns.tools -%}"
    "{%- if body -%}{{ body }}{{ '\\n\\n' }}{%- endif -%}{{ ns.tools }}"
    "{%- else -%}{{ body }}"
    "{%- endif -%}"
    "<|end|>"
    "{%- elif message.role == 'assistant' -%}"
    "<|assistant|><|think|>"
    "{%- if message.reasoning_content is defined and message.reasoning_content is not none -%}"
    "{{ message.reasoning_content }}"
    "{%- elif message.reasoning is defined and message.reasoning is not none -%}"
    "{{ message.reasoning }}"
    "{%- endif -%}"
    "<|/think|>{{ text(message.content) }}"
    "{%- if message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set args = call.function.arguments -%}"
    "<|tool_call|>"
    "{%- if args is string and args -%}"
    "{\"name\": {{ call.function.name | tojson }}, \"arguments\": {{ args }}}"
    "{%- else -%}"
    "{{ {'name': call.function.name, 'arguments': args if args else {}} | tojson }}"
    "{%- endif -%}"
    "<|/tool_call|>"
    "{%- endfor -%}"
    "{%- endif -%}"
    "<|end|>"
    "{%- else -%}"
    "{{ raise_exception('message ' ~ loop.index0 ~ ': unknown role ' ~ message.role) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson` filter (jinja2's own escapes HTML characters and sorts keys)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise ValueError(message)


def render_chat_jinja(template: str, messages: list[dict], tools: list[dict] | None = None,
                      add_generation_prompt: bool = True) -> str:
    """Render a Jinja chat template (e.g. tokenizer_config.json's "chat_template") with jinja2 the way
    transformers' `apply_chat_template` does: a sandboxed environment, trim_blocks and lstrip_blocks,
    its `tojson` filter and `raise_exception`."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # lazily: only checkpoints with a template need it

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template).render(messages=messages, tools=tools,
                                            add_generation_prompt=add_generation_prompt)


# ------------------------------------------------------------------ parsing

@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments_json: str


@dataclass
class ParsedAssistant:
    reasoning: str | None
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


def _parse_tool_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"} \
            or not isinstance(obj["name"], str) or not obj["name"] \
            or not isinstance(obj["arguments"], dict):
        return None
    return ToolCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))


# Markers that end the current span, per state. Anything else is literal text.
_START, _REASONING, _CONTENT, _CALL, _DONE = range(5)
_MARKERS = {
    _REASONING: (END_THINK, END),
    _CONTENT: (TOOL_CALL, END),
    _CALL: (END_TOOL_CALL, END),
}
_MARKER_RE = {s: re.compile("|".join(map(re.escape, m))) for s, m in _MARKERS.items()}


def _held_suffix(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest buffer suffix that could begin a marker."""
    for k in range(min(len(buf), max(map(len, markers)) - 1), 0, -1):
        tail = buf[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


class AssistantStreamParser:
    """Split streamed assistant text into events.

    Events: ("reasoning", text), ("content", text),
    ("tool_call_start", index, name), ("tool_call_args", index, args_delta).
    A tool call is emitted only once its block is complete and valid JSON
    (so a malformed one can still fall back to content, never half-emitted).
    """

    def __init__(self) -> None:
        self._state = _START
        self._buf = ""
        self._call = ""  # body of the open tool_call block
        self._n_calls = 0
        self._finished = False

    def feed(self, delta: str) -> list[tuple]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        events: list[tuple] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[tuple]:
        if self._finished:
            return []
        self._finished = True
        events: list[tuple] = []
        if self._state == _START:
            self._state = _CONTENT  # a lone prefix of <|think|> is just text
        if self._state in (_REASONING, _CONTENT):
            self._emit(events, self._buf)
        elif self._state == _CALL:
            self._call += self._buf
            self._close_call(events, closed=False)
        self._buf = ""
        self._state = _DONE
        return events

    def _emit(self, events: list, text: str) -> None:
        if text:
            kind = "reasoning" if self._state == _REASONING else "content"
            events.append((kind, text))

    def _close_call(self, events: list, closed: bool) -> None:
        call = _parse_tool_call(self._call)
        if call is None:
            raw = TOOL_CALL + self._call + (END_TOOL_CALL if closed else "")
            events.append(("content", raw))
        else:
            events.append(("tool_call_start", self._n_calls, call.name))
            events.append(("tool_call_args", self._n_calls, call.arguments_json))
            self._n_calls += 1
        self._call = ""

    def _step(self, events: list) -> bool:
        """Consume what can be decided from the buffer; True if progress made."""
        if self._state == _DONE:
            self._buf = ""  # anything after <|end|> is ignored
            return False
        if self._state == _START:
            if self._buf.startswith(THINK):
                self._buf = self._buf[len(THINK):]
                self._state = _REASONING
                return True
            if THINK.startswith(self._buf):
                return False  # still could be <|think|>
            self._state = _CONTENT  # no reasoning block: all content
            return True
        m = _MARKER_RE[self._state].search(self._buf)
        if m is None:
            keep = _held_suffix(self._buf, _MARKERS[self._state])
            text, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            if self._state == _CALL:
                self._call += text
            else:
                self._emit(events, text)
            return False
        text, marker, self._buf = self._buf[:m.start()], m.group(), self._buf[m.end():]
        if self._state == _CALL:
            self._call += text
            self._close_call(events, closed=marker == END_TOOL_CALL)
            self._state = _CONTENT
        else:
            self._emit(events, text)
            if marker == END_THINK:
                self._state = _CONTENT
            elif marker == TOOL_CALL:
                self._state = _CALL
        if marker == END:
            self._state = _DONE
        return True


def collect_events(events: list[tuple]) -> ParsedAssistant:
    """Fold parser events into a ParsedAssistant (reasoning None if empty)."""
    reasoning, content, names, args = [], [], {}, {}
    for ev in events:
        if ev[0] == "reasoning":
            reasoning.append(ev[1])
        elif ev[0] == "content":
            content.append(ev[1])
        elif ev[0] == "tool_call_start":
            names[ev[1]], args[ev[1]] = ev[2], []
        elif ev[0] == "tool_call_args":
            args[ev[1]].append(ev[2])
    calls = [ToolCall(names[i], "".join(args[i])) for i in sorted(names)]
    return ParsedAssistant("".join(reasoning) or None, "".join(content), calls)


def parse_assistant(text: str) -> ParsedAssistant:
    """Parse a completed assistant output (text after `<|assistant|>`)."""
    parser = AssistantStreamParser()
    return collect_events(parser.feed(text) + parser.finish())
