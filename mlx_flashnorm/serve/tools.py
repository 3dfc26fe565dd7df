"""Tool calls (OpenAI's `tools` and `tool_choice`): the tools checked and put into the prompt, the
call forced by a grammar where tool_choice asks for one, and the model's tool-call text parsed back
into `message.tool_calls` (ToolCalls, whole or streamed).

Two forms of call text, by the chat template's family:
- "hermes" (Qwen 2/2.5/3, and every template that renders no tools, SmolLM2's among them):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one element per call;
- "llama" (Llama 3.x's templates, which speak of `<|python_tag|>`): the reply is one JSON object
  `{"name": ..., "parameters": {...}}`, maybe after `<|python_tag|>`.
A template that renders tools itself gets them (apply_chat_template's tools=) and the messages as
Hugging Face's templates take them (a call's arguments an object). For a template that renders no
tools the server writes their description into the system message (SYSTEM, then each function's
JSON, one a line), an assistant's calls as its `<tool_call>` elements and a tool's result as a user
message `<tool_response>RESULT</tool_response>`."""
import json
import re
import uuid
from dataclasses import dataclass

from .. import constraints
from .structured import NAME, FormatError, schema_grammar

SYSTEM = ("You can call functions. To call one, reply with only\n<tool_call>\n"
          '{"name": FUNCTION_NAME, "arguments": ARGUMENTS_OBJECT}\n</tool_call>\n'
          "The functions, as JSON:\n")
OPEN, CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
ANY_OBJECT = {"type": "object"}


@dataclass
class Tools:
    """A request's checked tools: functions [{"name", "description"?, "parameters"?}], choice
    ("auto", "none", "required" or a function's name), the family of call text and whether the
    template renders the tools (native)."""
    functions: list
    choice: str
    family: str
    native: bool

    @property
    def forced(self):
        return self.choice not in ("auto", "none")

    def grammar(self):
        """The grammar of a forced call (llguidance's Lark, the arguments a JSON schema each):
        "required" any of the functions, a name that one; None where the model chooses."""
        if not self.forced:
            return None
        chosen = [f for f in self.functions if self.choice in ("required", f["name"])]
        key = "parameters" if self.family == "llama" else "arguments"
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                   key: f.get("parameters") or ANY_OBJECT},
                  "required": ["name", key], "additionalProperties": False} for f in chosen]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        call = f"%json {json.dumps(schema)}"
        if self.family == "llama":
            return constraints.lark_grammar(f"start: {call}\n")
        return constraints.lark_grammar(f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: {call}\n')

    def messages(self, messages):
        """(messages, kwargs) for apply_chat_template."""
        if self.native:
            out = [dict(m, tool_calls=[native_call(c) for c in m["tool_calls"]])
                   if m.get("tool_calls") else m for m in messages]
            tools = [] if self.choice == "none" else self.functions
            listed = [{"type": "function", "function": f} for f in tools]
            return out, {"tools": listed} if tools else {}
        out = [hermes_message(m) for m in messages]
        if self.choice != "none":
            listed = SYSTEM + "\n".join(json.dumps(f) for f in self.functions)
            if out and out[0]["role"] == "system":
                out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{listed}")
            else:
                out.insert(0, {"role": "system", "content": listed})
        return out, {}


def native_call(call):
    """An OpenAI tool call as Hugging Face's templates take it (arguments an object)."""
    f = call["function"]
    try:
        arguments = json.loads(f["arguments"])
    except ValueError:
        arguments = f["arguments"]
    return {"type": "function", "id": call.get("id"),
            "function": {"name": f["name"], "arguments": arguments}}


def hermes_message(m):
    """A message for a template that renders no tools: calls and results as text."""
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
    if m.get("tool_calls"):
        calls = "\n".join(f'{OPEN}\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
                          f'{c["function"]["arguments"]}}}\n{CLOSE}' for c in m["tool_calls"])
        return {"role": m["role"], "content": f"{m['content']}\n{calls}" if m["content"] else calls}
    return {"role": m["role"], "content": m["content"]}


def family(template):
    """The call text a chat template's model writes: "llama" where it speaks of <|python_tag|>
    or ipython, else "hermes"."""
    return "llama" if PYTHON_TAG in template or "ipython" in template else "hermes"


def parse_tools(body, template):
    """The Tools of a chat request (None without tools, or tool_choice "none" without them);
    template: the chat template's source. FormatError for a field at fault."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise FormatError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise FormatError("'tools' must be a non-empty list of {'type': 'function', 'function': "
                          "{...}} objects", "tools")
    functions = [function(t, k) for k, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise FormatError("each of 'tools' must have its own name", "tools")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        f = choice.get("function")
        if (choice.get("type") != "function" or not isinstance(f, dict)
                or not isinstance(f.get("name"), str)):
            raise FormatError("'tool_choice' must be 'auto', 'none', 'required' or {'type': "
                              "'function', 'function': {'name': ...}}", "tool_choice")
        if f["name"] not in names:
            raise FormatError(f"'tool_choice' names '{f['name']}', which is not one of 'tools'",
                              "tool_choice")
        choice = f["name"]
    elif choice not in ("auto", "none", "required"):
        raise FormatError("'tool_choice' must be 'auto', 'none', 'required' or {'type': "
                          "'function', 'function': {'name': ...}}", "tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise FormatError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    return Tools(functions, choice, family(template), "tools" in template)


def function(tool, k):
    """tools[k]'s function, checked: {"name", "description"?, "parameters"?}."""
    where = f"tools[{k}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
            tool.get("function"), dict):
        raise FormatError(f"'{where}' must be {{'type': 'function', 'function': {{...}}}}", "tools")
    f = tool["function"]
    if extra := sorted(set(f) - {"name", "description", "parameters", "strict"}):
        raise FormatError(f"'{where}.function' takes no '{extra[0]}'", "tools")
    if not isinstance(f.get("name"), str) or not NAME.match(f["name"]):
        raise FormatError(f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-'",
                          "tools")
    if f.get("description") is not None and not isinstance(f["description"], str):
        raise FormatError(f"'{where}.function.description' must be a string", "tools")
    if f.get("parameters") is not None:
        schema_grammar(f["parameters"], f"'{where}.function.parameters'", "tools")
    return {k: v for k, v in f.items() if k != "strict" and v is not None}


def check_messages(messages):
    """A chat's tool fields checked: an assistant's tool_calls, a tool message's tool_call_id."""
    for m in messages:
        calls = m.get("tool_calls")
        if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list)
                                  or not all(map(well_formed, calls))):
            raise FormatError("an assistant message's 'tool_calls' must be a list of {'id', "
                              "'type': 'function', 'function': {'name', 'arguments': a JSON "
                              "text}}", "messages")
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise FormatError("a 'tool' message needs the 'tool_call_id' string of the call it "
                              "answers", "messages")


def well_formed(call):
    """Whether an assistant message's tool call is {"id"?, "type": "function", "function":
    {"name", "arguments": a string}}."""
    f = call.get("function") if isinstance(call, dict) else None
    return (call.get("type", "function") == "function" and isinstance(f, dict)
            and isinstance(f.get("name"), str) and isinstance(f.get("arguments"), str))


def call_id():
    return f"call_{uuid.uuid4().hex[:24]}"


# a call's text up to its arguments, when its name comes first
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*'
                  r'"(?:arguments|parameters)"\s*:\s*')


class Call:
    """One call being read: its text after the opening, its name and arguments once known."""

    def __init__(self, index, closing):
        self.index, self.closing, self.text = index, closing, ""
        self.id, self.name, self.sent = call_id(), None, 0  # sent: argument characters sent
        self.arguments = ""  # those sent
        self.start = None  # where the arguments begin in text
        self.end = None  # where they end (their object closed)

    def scan(self):
        """Find the name, and where the arguments object ends (a scan of its braces)."""
        if self.start is None and (m := HEAD.match(self.text)):
            self.name, self.start = json.loads(m.group(1)), m.end()
        if self.start is None or self.end is not None or not self.text[self.start:].strip():
            return
        body = self.text[self.start:]
        self.start += len(body) - len(body.lstrip())
        body = body.lstrip()
        if body[0] != "{":
            return
        depth, string, escape = 0, False, False
        for k, c in enumerate(body):
            if string:
                escape, string = (False, True) if escape else (c == "\\", c != '"')
            elif c == '"':
                string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    self.end = self.start + k + 1
                    return

    def whole(self):
        """(name, arguments JSON text) of the whole call text, or None if it is not one."""
        try:
            obj = json.loads(self.text.strip())
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return obj["name"], args if isinstance(args, str) else json.dumps(args)


class ToolCalls:
    """A reply's text split into content and tool calls, piece by piece: feed(piece, last)
    returns (content, deltas), deltas in OpenAI's streamed form (a call's id, type and name first,
    then its arguments in pieces as they come); calls, once done, the whole calls."""

    def __init__(self, tools):
        self.tools, self.buffer, self.call, self.calls = tools, "", None, []
        self.names = {f["name"] for f in tools.functions}
        self.started = False  # some content was sent: a bare JSON reply is content then

    def feed(self, piece, last=False):
        self.buffer += piece
        content, deltas = "", []
        while True:
            if self.call is None:
                text, opened = self._opening(last)
                content += text
                if not opened:
                    break
            done, text = self._advance(deltas, last)
            content += text
            if not done:
                break
        return content, deltas

    def _opening(self, last):
        """Content up to a call's opening (then a Call begins), holding back what may begin one."""
        b = self.buffer
        k = b.find(OPEN)
        if k >= 0:
            self.buffer, self.call = b[k + len(OPEN):], Call(len(self.calls), CLOSE)
            self.started = self.started or bool(b[:k].strip())
            return b[:k].strip() if not self.started else b[:k], True
        stripped = b.lstrip()
        if not self.started and self.tools.family == "llama" and stripped.startswith(
                (PYTHON_TAG, "{")):
            self.buffer = stripped.removeprefix(PYTHON_TAG)
            self.call = Call(len(self.calls), None)
            return "", True
        if not self.started and not last and (not stripped or PYTHON_TAG.startswith(stripped)
                                              and self.tools.family == "llama"):
            return "", False
        held = 0 if last else max((n for n in range(1, len(OPEN)) if b.endswith(OPEN[:n])),
                                  default=0)
        text, self.buffer = b[:len(b) - held], b[len(b) - held:]
        self.started = self.started or bool(text.strip())
        return text, False

    def _advance(self, deltas, last):
        """Read the call's text: its head and argument pieces as deltas. (True once it closed,
        content: its text where it was no call after all)."""
        c = self.call
        c.text, self.buffer = c.text + self.buffer, ""
        closed = c.closing is not None and c.closing in c.text
        if closed:
            k = c.text.find(c.closing)
            c.text, self.buffer = c.text[:k], c.text[k + len(c.closing):]
        c.scan()
        if c.name is not None and c.index == len(self.calls) and c.name in self.names:
            deltas.append({"index": c.index, "id": c.id, "type": "function",
                           "function": {"name": c.name, "arguments": ""}})
            self.calls.append(None)  # its place, filled once it closes
        streamed = c.index < len(self.calls)
        if streamed and c.text[c.start:].lstrip().startswith("{"):
            end = c.end if c.end is not None else len(c.text)
            self._send(c, c.text[c.start + c.sent:end], deltas)
        if not (closed or last):
            return False, ""
        self.call, whole = None, c.whole()
        if streamed:
            if c.sent == 0:  # arguments not an object: sent whole
                self._send(c, whole[1] if whole else c.text[c.start:].strip(), deltas)
            self.calls[c.index] = {"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}}
            return True, ""
        if whole is not None and whole[0] in self.names:  # its head came in another form
            self.calls.append({"id": c.id, "type": "function",
                               "function": {"name": whole[0], "arguments": whole[1]}})
            deltas.append(dict(self.calls[-1], index=c.index))
            return True, ""
        self.started = True  # not a call after all: its text is content
        return True, f"{OPEN}{c.text}{CLOSE if closed else ''}" if c.closing else c.text

    @staticmethod
    def _send(c, piece, deltas):
        if piece:
            deltas.append({"index": c.index, "function": {"arguments": piece}})
            c.sent += len(piece)
            c.arguments += piece
