"""Chat templates. --chat-template: a Jinja chat template given on the command line (a file or the
text itself), rendered as Hugging Face's apply_chat_template renders one (a sandboxed Jinja
environment with trim_blocks and lstrip_blocks, raise_exception and the tokenizer's special
tokens), for any of our tokenizers, a GGUF's included. encode_chat: messages through a tokenizer's
template to token ids, the control tokens the template's alone."""
import re
from functools import lru_cache
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import UserError


def read_template(value):
    """The template text: the file `value` names, else `value` itself (it must look like Jinja)."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: cannot read the chat template ({type(e).__name__}: {e})")
    if "{{" not in value and "{%" not in value:
        raise UserError(f"--chat-template {value!r}: no such file, and not a Jinja template "
                        "(no {{ or {%); pass a template file or the template text")
    return value


def compile_template(text):
    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(text)
    except TemplateError as e:
        raise UserError(f"the chat template is not valid Jinja ({e})")


def set_chat_template(tokenizer, value):
    """Make the wrapped tokenizer (mlx-lm's TokenizerWrapper) render chats with the template that
    value gives (read_template); the wrapper then encodes the text without adding special tokens,
    as it does for a template of its own."""
    template = compile_template(read_template(value))
    specials = {k: getattr(tokenizer, k, None) or ""
                for k in ("bos_token", "eos_token", "unk_token", "pad_token")}

    def render(messages, add_generation_prompt=False, **kwargs):
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **specials, **kwargs)
        except TemplateError as e:
            raise UserError(f"the chat template failed to render: {e}")

    tokenizer._chat_template = render
    tokenizer.has_chat_template = True
    return tokenizer


def special_tokens(tokenizer):
    """{text: id} of the special tokens that the tokenizer's encode finds in text (a Hugging Face
    tokenizer's special added tokens; a sentencepiece one finds none)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {t.content: i for i, t in added.items() if getattr(t, "special", False)}


@lru_cache(maxsize=16)
def _pattern(texts):
    """A regular expression matching any of texts, the longest first (None for none)."""
    if not texts:
        return None
    return re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True))))


@lru_cache(maxsize=4)
def _as_text(backend):
    """A copy of a tokenizers.Tokenizer that encodes special tokens' text as text: the shared one
    is never switched to it (the server's threads encode at once with it)."""
    copy = type(backend).from_str(backend.to_str())
    copy.encode_special_tokens = True
    return copy


def encode_as_text(tokenizer, text):
    """text's token ids with no special token parsed (the added tokens that are not special still
    are, as encode parses them)."""
    backend = getattr(getattr(tokenizer, "_tokenizer", None), "_tokenizer", None)
    if hasattr(backend, "encode_special_tokens"):  # mlx-lm's wrapper of a transformers fast one
        return _as_text(backend).encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def _encode_within(encode, piece, newline):
    """encode(piece) for a piece from inside a text: after a newline, which is then dropped, so
    that a sentencepiece-style tokenizer adds none of the space it adds at a text's start (the
    newline not kept apart: piece alone)."""
    ids = encode("\n" + piece)
    return ids[len(newline):] if ids[:len(newline)] == newline else encode(piece)


def encode_chat(tokenizer, messages, parse_special=False, **template_args):
    """Token ids of messages ({"role", "content"} strings) through the tokenizer's chat template,
    with the generation prompt. A special token's text in a message (`<|im_end|>` in a user's
    content) is ordinary text, its text's ids in place of the token's, so that only the template
    writes control tokens: a message cannot end its turn and write others. The template is
    rendered with each such text between two markers (a private-use character in no message); the
    text outside them is tokenized as before, the marked texts as text (as transformers'
    apply_chat_template(sanitize_control_tokens=True) does, on any template and version).
    parse_special: the text parsed for special tokens too, as the tokenizer parses any text.
    template_args: the template's other arguments (tools=)."""
    specials = {} if parse_special else special_tokens(tokenizer)
    pattern = _pattern(tuple(specials))
    strings = [v for m in messages for v in m.values() if isinstance(v, str)]
    if pattern is None or not any(pattern.search(v) for v in strings):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  **template_args))
    mark = next(c for c in map(chr, range(0xE000, 0xF900)) if not any(c in v for v in strings))
    marked = [{k: pattern.sub(lambda t: mark + t[0] + mark, v) if isinstance(v, str) else v
               for k, v in m.items()} for m in messages]
    text = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False,
                                         **template_args)
    # [text, marked, text, marked, ..., text]; a marker the template parted from its pair: None
    pieces = re.split(f"{mark}({pattern.pattern}){mark}|{mark}", text)

    def encode(piece):
        return tokenizer.encode(piece, add_special_tokens=False)

    def as_text(piece):
        return encode_as_text(tokenizer, piece)

    newline, ids = encode("\n"), encode(pieces[0])
    for i, piece in enumerate(pieces[1:], start=1):
        if piece:
            got = _encode_within(as_text if i % 2 else encode, piece, newline)
            if i % 2 and specials[piece] in got:
                raise ValueError(f"{piece!r} in a message is read as the special token even as "
                                 "text")
            ids += got
    return ids
