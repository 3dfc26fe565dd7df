"""The OpenAI forms of the server's requests and answers: a request body checked and turned into a
Call (a requests.Generation and what the answer needs), every field range-checked before the
request is queued; and the tokens that come back turned into the client's text, cut at stop
strings, with their log-probabilities in the chat or the completions shape (Transcript)."""
import json
import math
import time
import uuid
from dataclasses import dataclass, field as dataclass_field

from jinja2 import TemplateError

from ..decoding import MAX_SEED, encode_chat
from .requests import Generation
from .structured import FormatError, response_format
from .tools import ToolCalls, Tools, check_messages, family, parse_tools

MAX_LOGPROBS = 20  # top_logprobs (chat) and logprobs (completions) at most
MAX_STOPS = 16
# a temperature below this decodes greedily: sampling scales the log-probabilities by
# 1/temperature in the model's dtype, which in float16 overflows beyond 65504 (vLLM takes those
# below 1e-5 as greedy)
MIN_TEMPERATURE = 1e-4
# repetition_penalty's range: the logits are divided (or multiplied) by it in the model's dtype;
# an integer beyond 64 bits is a C++ exception in MLX, a number that rounds to 0 there makes NaNs
PENALTY_RANGE = (0.01, 100)
# the log-probability written for -inf (JSON has no infinities; OpenAI writes this)
UNSURE = -9999.0
DECODE_CONTEXT = 4  # prompt tokens decoded before the first generated one (its leading space)

COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
          "stream_options", "n", "logprobs", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "user", "response_format"}
# a chat's fields that change nothing here, OpenAI's bookkeeping (mlx_lm.server ignores them too),
# and parallel_tool_calls (a forced call makes one call: tools.py): checked for their type alone
IGNORED = {"store": bool, "metadata": dict, "service_tier": str, "parallel_tool_calls": bool,
           "prompt_cache_key": str, "safety_identifier": str}
FIELDS = {True: COMMON | set(IGNORED) | {"messages", "max_completion_tokens", "top_logprobs",
                                         "tools", "tool_choice"},
          False: COMMON | {"prompt", "echo"}}  # completions
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               500: "server_error", 503: "server_error", 504: "server_error"}


class HTTPError(Exception):
    """An answer other than 200: status, a message saying what to do, the request field at fault."""

    def __init__(self, status, message, param=None, headers=()):
        super().__init__(message)
        self.status, self.param, self.headers = status, param, dict(headers)

    def body(self):
        kind = ERROR_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": None}}


def bad(message, param=None):
    return HTTPError(400, message, param)


def field(body, name, types, default=None, ok=lambda v: True, need=""):
    """body[name] if it has the right type and passes ok, default if absent or null."""
    value, types = body.get(name), types if isinstance(types, tuple) else (types,)
    if value is None:
        return default
    if (not isinstance(value, types) or isinstance(value, bool) and bool not in types
            or not ok(value)):
        raise bad(f"'{name}' must be {need}", name)
    return value


def number(body, name, default, ok, need):
    """A finite number (an integer of any size is one) that passes ok."""
    return field(body, name, (int, float), default,
                 lambda v: (isinstance(v, int) or math.isfinite(v)) and ok(v), need)


def parse_json(raw):
    """The request body as a JSON object; a 400 for anything else (invalid JSON or UTF-8, nesting
    too deep for the parser, a string holding an unpaired surrogate escape such as \\ud800)."""
    try:
        body = json.loads(raw)
        json.dumps(body, ensure_ascii=False).encode()  # unpaired surrogates cannot be encoded
    except RecursionError:
        raise bad("the request body is nested too deeply")
    except UnicodeEncodeError:
        raise bad("a string in the request body holds an unpaired surrogate (\\ud800-\\udfff): "
                  "it is not valid Unicode")
    except ValueError as e:
        raise bad(f"the request body is not valid JSON: {e}")
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def message_text(content):
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad("a message's 'content' must be a string or a list of text parts", "messages")


def template(tokenizer):
    """The chat template's source ("" for none)."""
    t = getattr(tokenizer, "chat_template", None)
    return t if isinstance(t, str) else ""


def chat_tokens(body, tokenizer, tools=None, parse_special=False, tokenize=True):
    """The prompt's token ids: the messages (and tools: tools.Tools) through the chat template
    (decoding.encode_chat: a special token's text in a message is text, unless parse_special);
    tokenize=False: the template rendered, its text."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of messages", "messages")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise bad("each message must be an object with a 'role' string", "messages")
    if extra := sorted(k for m in messages for k in m
                       if k not in ("role", "content", "tool_calls", "tool_call_id")
                       and m[k] is not None):
        raise bad(f"a message's '{extra[0]}' is not supported (only 'role', 'content', "
                  "'tool_calls' and 'tool_call_id')", "messages")
    try:
        check_messages(messages)
    except FormatError as e:
        raise bad(str(e), e.param)
    # (an assistant's calls may come without content)
    messages = [dict({k: m[k] for k in ("tool_calls", "tool_call_id") if m.get(k) is not None},
                     role=m["role"], content=message_text(
                         "" if m.get("content") is None and m.get("tool_calls")
                         else m.get("content", "")))
                for m in messages]
    if not tokenizer.has_chat_template:
        raise bad("this model has no chat template: use /v1/completions")
    extra = {}
    if tools is not None:
        messages, extra = tools.messages(messages)
    elif any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        # a chat about calls made earlier, no tools offered now
        t = template(tokenizer)
        messages, _ = Tools([], "none", family(t), "tools" in t).messages(messages)
    try:
        if not tokenize:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False, **extra)
        return encode_chat(tokenizer, messages, parse_special, **extra)
    except (TemplateError, ValueError, TypeError) as e:
        raise bad(f"the model's chat template refused the messages: {e}", "messages")


def completion_tokens(body, tokenizer, vocab):
    """The prompt's token ids and its text: a string, or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt), prompt
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
        return list(prompt), decode(tokenizer, prompt)
    raise bad(f"'prompt' must be a non-empty string or a list of token ids below {vocab} "
              "(one prompt per request)", "prompt")


def logit_bias(body, vocab):
    bias = field(body, "logit_bias", dict, None, need="an object of token ids and numbers")
    if not bias:
        return None
    if not all(k.isascii() and k.isdigit() and len(k) < 12 and int(k) < vocab
               and isinstance(v, (int, float)) and not isinstance(v, bool) and -100 <= v <= 100
               for k, v in bias.items()):
        raise bad(f"'logit_bias' must map token ids (below {vocab}) to numbers from -100 to 100",
                  "logit_bias")
    return {int(k): float(v) for k, v in bias.items()}


@dataclass
class Call:
    """A checked request: what to generate, and how to answer."""
    chat: bool
    generation: Generation
    stream: bool = False
    include_usage: bool = False
    stop: list = dataclass_field(default_factory=list)
    # completions' log-probabilities: where the completion starts in prompt + it
    text_offset: int = 0
    tools: object = None  # tools.Tools: a chat's tools, its answer's text parsed for calls


def shape(body, chat, tokenizer):
    """(grammar, tools): the grammar the answer follows (response_format's, or a forced tool
    call's; None: free), and a chat's tools.Tools (None without)."""
    try:
        grammar = response_format(body)
        tools = parse_tools(body, template(tokenizer)) if chat else None
        if tools is not None and tools.forced:
            if grammar is not None:
                raise FormatError("'response_format' and a 'tool_choice' that forces a call "
                                  "cannot both shape the answer", "response_format")
            grammar = tools.grammar()
    except FormatError as e:
        raise bad(str(e), e.param)
    return grammar, tools


def parse_call(body, chat, tokenizer, context, vocab, defaults, parse_special=False, choices=1):
    """The Call of a request body (parse_json's), or a 400 naming the field at fault. defaults:
    max_tokens, temp, top_p, top_k for the fields a request leaves out; context: the model's;
    parse_special: a chat's messages parsed for special tokens' text (chat_tokens); choices: the
    most `n` the worker takes."""
    if unknown := sorted(k for k in body if k not in FIELDS[chat] and body[k] is not None):
        raise bad(f"'{unknown[0]}' is not supported by this server", unknown[0])
    field(body, "model", str, need="a string")
    field(body, "user", str, need="a string")
    needs = {bool: "true or false", dict: "an object", str: "a string"}
    for name, kind in IGNORED.items() if chat else ():
        field(body, name, kind, need=needs[kind])
    n = field(body, "n", int, 1, lambda v: 1 <= v <= choices,
              f"an integer from 1 to {choices}: the choices this server generates for one request "
              "(a row of the batch each, at most --max-concurrent)")
    field(body, "echo", bool, False, lambda v: not v, "false: echoing the prompt is not supported")
    grammar, tools = shape(body, chat, tokenizer)
    if chat:
        tokens, offset = chat_tokens(body, tokenizer, tools, parse_special), 0
    else:
        tokens, prompt = completion_tokens(body, tokenizer, vocab)
        offset = len(prompt)
    where = "messages" if chat else "prompt"
    if max(tokens, default=0) >= vocab:  # a tokenizer's id past the embedding: never run
        raise bad(f"the prompt's token id {max(tokens)} is beyond the vocabulary ({vocab})", where)
    if len(tokens) >= context:
        raise bad(f"the prompt has {len(tokens)} tokens, the model's context is {context}", where)
    room = context - len(tokens)
    name = ("max_tokens" if body.get("max_tokens") is not None or not chat
            else "max_completion_tokens")
    max_tokens = field(body, name, int, None, lambda v: v >= 1, "a positive integer")
    if max_tokens is None:
        max_tokens = min(defaults["max_tokens"], room)
    elif max_tokens > room:
        raise bad(f"'{name}' is {max_tokens}, but the prompt's {len(tokens)} tokens leave room for "
                  f"{room} in the model's context of {context}", name)
    if chat:
        wants = field(body, "logprobs", bool, False, need="true or false")
        top = field(body, "top_logprobs", int, None, lambda v: 0 <= v <= MAX_LOGPROBS,
                    f"an integer from 0 to {MAX_LOGPROBS}")
        if top is not None and not wants:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        top = (top or 0) if wants else None
    else:
        top = field(body, "logprobs", int, None, lambda v: 0 <= v <= MAX_LOGPROBS,
                    f"an integer from 0 to {MAX_LOGPROBS}")
    stop = field(body, "stop", (str, list), [],
                 lambda v: v if isinstance(v, str)
                 else len(v) <= MAX_STOPS and all(isinstance(s, str) and s for s in v),
                 f"a non-empty string or a list of at most {MAX_STOPS} of them")
    options = field(body, "stream_options", dict, {}, need="an object")
    temp = float(number(body, "temperature", defaults["temp"], lambda v: 0 <= v <= 2,
                        "a number from 0 to 2"))
    low, high = PENALTY_RANGE
    penalty = number(body, "repetition_penalty", None, lambda v: low <= v <= high,
                     f"a number from {low} to {high} (1 is off)")
    generation = Generation(
        tokens, max_tokens,
        seed=field(body, "seed", int, None, lambda v: 0 <= v <= MAX_SEED,
                   f"an integer from 0 to {MAX_SEED}"),
        temp=temp if temp >= MIN_TEMPERATURE else 0.0,
        top_p=number(body, "top_p", defaults["top_p"], lambda v: 0 < v <= 1,
                     "a number above 0 and at most 1"),
        # (mlx-lm's top-k filter takes fewer than the vocabulary's tokens: beyond, it raises
        # inside a compiled function, and the random state it shares is left broken)
        top_k=field(body, "top_k", int, defaults["top_k"], lambda v: 0 <= v < vocab,
                    f"an integer from 0 to {vocab - 1} (0 is off)"),
        min_p=number(body, "min_p", 0.0, lambda v: 0 <= v <= 1, "a number from 0 to 1 (0 is off)"),
        repetition_penalty=penalty and float(penalty),
        presence_penalty=number(body, "presence_penalty", None, lambda v: -2 <= v <= 2,
                                "a number from -2 to 2"),
        frequency_penalty=number(body, "frequency_penalty", None, lambda v: -2 <= v <= 2,
                                 "a number from -2 to 2"),
        logit_bias=logit_bias(body, vocab), top_logprobs=top, grammar=grammar, n=n)
    return Call(chat, generation, stream=field(body, "stream", bool, False, need="true or false"),
                include_usage=field(options, "include_usage", bool, False, need="true or false"),
                stop=[stop] if isinstance(stop, str) else stop, text_offset=offset,
                tools=tools if tools is not None and tools.choice != "none" else None)


def decode(tokenizer, ids):
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def held_back(text, stops):
    """How many characters at the end of text might begin a stop string (not to be sent yet)."""
    return max((k for s in stops for k in range(1, min(len(s), len(text) + 1))
                if text.endswith(s[:k])), default=0)


@dataclass
class Entry:
    token: object  # requests.Token
    start: int  # where its text begins in the completion


class Transcript:
    """A request's tokens as the client reads them: decoded into text piece by piece, cut at the
    first stop string, held back while its end might begin one; with each piece the tokens (Entry)
    whose text it completes, for their log-probabilities.

    Each token's text is the difference between decoding a window of tokens with and without it,
    the window starting at the last few prompt tokens, so that a continuation's leading space is
    kept (a decoder strips the space at the start of a text), and waiting while the text ends in an
    incomplete UTF-8 character (U+FFFD)."""

    def __init__(self, tokenizer, call):
        self.tokenizer, self.stops = tokenizer, call.stop
        self.longest = max(map(len, self.stops), default=0)
        self.window = list(call.generation.tokens[-DECODE_CONTEXT:])
        self.begin = 0  # window[begin:seen] decodes to text already counted
        self.seen = len(self.window)
        self.counted = None  # that text, once decoded (until begin and seen move)
        self.text, self.sent, self.count = "", 0, 0
        self.finish = None  # once it ended: "stop" or "length"
        self.cached = 0  # prompt tokens that came from the prompt cache (the first token says)
        self.pending = []  # Entries not yet sent

    def decode_next(self, token_id, last):
        """The text that token_id completes (it may complete held ones' too): "" while the text
        might end in an incomplete character, unless last."""
        self.window.append(token_id)
        after = decode(self.tokenizer, self.window[self.begin:])
        if not last and (after.endswith("\ufffd") or len(after) <= len(self.decoded())):
            return ""
        return self.flush(after)

    def decoded(self):
        if self.counted is None:
            self.counted = decode(self.tokenizer, self.window[self.begin:self.seen])
        return self.counted

    def flush(self, after=None):
        """The text of the tokens held so far; they count as decoded from now on."""
        before, after = self.decoded(), (decode(self.tokenizer, self.window[self.begin:])
                                         if after is None else after)
        self.begin, self.seen, self.counted = self.seen, len(self.window), None
        return after[len(before):]

    def add(self, token):
        """(piece, finish_reason, entries) for the client on one requests.Token: finish_reason is
        None until the end, "stop" (an end-of-sequence token or a stop string) or "length"."""
        finish = token.finish_reason
        self.cached = token.cached or self.cached
        if finish == "stop":  # an end-of-sequence token: neither text nor counted
            self.text += self.flush()
        else:
            self.count += 1
            start = len(self.text)
            self.text += self.decode_next(token.id, last=finish is not None)
            self.pending.append(Entry(token, start))
        cuts = [i for i in (self.text.find(s, max(0, self.sent - self.longest)) for s in self.stops)
                if i >= 0]
        if cuts:
            self.text, finish = self.text[:min(cuts)], "stop"
            self.pending = [e for e in self.pending if e.start < len(self.text)]
        end = len(self.text) if finish else len(self.text) - held_back(self.text, self.stops)
        done = len(self.pending) if finish else sum(1 for e in self.pending if e.start < end)
        entries, self.pending = self.pending[:done], self.pending[done:]
        piece, self.sent = self.text[self.sent:end], end
        self.finish = finish
        return piece, finish, entries


def token_text(tokenizer, token_id):
    return decode(tokenizer, [token_id])


def finite(logprob):
    return logprob if math.isfinite(logprob) else UNSURE


def chat_logprobs(tokenizer, entries):
    def item(i, lp):
        text = token_text(tokenizer, i)
        return {"token": text, "logprob": finite(lp), "bytes": list(text.encode())}

    return {"content": [dict(item(e.token.id, e.token.logprob),
                             top_logprobs=[item(i, lp) for i, lp in e.token.top_logprobs])
                        for e in entries],
            "refusal": None}


def completion_logprobs(tokenizer, entries, offset):
    return {"tokens": [token_text(tokenizer, e.token.id) for e in entries],
            "token_logprobs": [finite(e.token.logprob) for e in entries],
            "top_logprobs": [{token_text(tokenizer, i): finite(lp)
                              for i, lp in e.token.top_logprobs}
                             for e in entries],
            "text_offset": [offset + e.start for e in entries]}


class Answer:
    """The JSON of one Call's answer, whole or as server-sent-event chunks, of its n choices."""

    def __init__(self, call, tokenizer, model_id):
        self.call, self.tokenizer = call, tokenizer
        # a chat with tools: each choice's text split into content and calls
        self.calls = ([ToolCalls(call.tools) for _ in range(call.generation.n)]
                      if call.tools is not None else None)
        chat = call.chat
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                     "object": "chat.completion" if chat else "text_completion",
                     "created": int(time.time()), "model": model_id}

    def logprobs(self, entries):
        if self.call.generation.top_logprobs is None:
            return None
        if self.call.chat:
            return chat_logprobs(self.tokenizer, entries)
        return completion_logprobs(self.tokenizer, entries, self.call.text_offset)

    def usage(self, transcripts):
        """The prompt once, the choices' tokens (Transcript.count) summed; cached: the prompt's
        tokens from the prompt cache (mlx_lm.server's prompt_tokens_details; the first choice's
        first token says)."""
        prompt, tokens = len(self.call.generation.tokens), sum(t.count for t in transcripts)
        return {"prompt_tokens": prompt, "completion_tokens": tokens,
                "total_tokens": prompt + tokens,
                "prompt_tokens_details": {"cached_tokens": transcripts[0].cached}}

    def whole(self, transcripts, entries):
        """The answer in one piece: each choice's text from its Transcript, entries[i] its
        tokens' Entries."""
        return dict(self.head, choices=[self.choice(i, t.text[:t.sent], t.finish, e)
                                        for i, (t, e) in enumerate(zip(transcripts, entries))],
                    usage=self.usage(transcripts))

    def choice(self, index, text, finish, entries):
        message = {"role": "assistant", "content": text}
        if self.calls is not None:
            calls = self.calls[index]
            content, _ = calls.feed(text, last=True)
            if calls.calls:
                message = {"role": "assistant", "content": content or None,
                           "tool_calls": calls.calls}
                finish = "tool_calls" if finish == "stop" else finish
        choice = {"index": index, "finish_reason": finish, "logprobs": self.logprobs(entries)}
        choice.update({"message": message} if self.call.chat else {"text": text})
        return choice

    def chunk(self, text, finish, entries, role=None, index=0):
        """A streamed chunk of choice `index`'s text (None: a chat with tools holds it back: it
        may begin a call)."""
        if not self.call.chat:
            choice = {"index": index, "text": text, "finish_reason": finish,
                      "logprobs": self.logprobs(entries)}
            return dict(self.head, choices=[choice])
        calls = []
        if self.calls is not None and not role:
            parser = self.calls[index]
            text, calls = parser.feed(text, last=finish is not None)
            if parser.calls and finish == "stop":
                finish = "tool_calls"
        delta = {"role": role, "content": text} if role else ({"content": text} if text else {})
        if calls:
            delta["tool_calls"] = calls
        if self.calls is not None and not (delta or finish or entries):
            return None  # text held back (it may begin a call)
        choice = {"index": index, "delta": delta, "finish_reason": finish,
                  "logprobs": self.logprobs(entries) if entries else None}
        return dict(self.head, object="chat.completion.chunk", choices=[choice])

    def usage_chunk(self, transcripts):
        return dict(self.head,
                    object="chat.completion.chunk" if self.call.chat else "text_completion",
                    choices=[], usage=self.usage(transcripts))
