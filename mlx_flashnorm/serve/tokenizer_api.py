"""llama-server's tokenizer endpoints, under its names and forms:

    POST /tokenize        {"content": str, "add_special": bool?, "with_pieces": bool?}
                          -> {"tokens": [id, ...]}, or with_pieces: {"tokens": [{"id", "piece"}]}
    POST /detokenize      {"tokens": [id, ...]} -> {"content": str}
    POST /apply-template  {"messages": [...]} -> {"prompt": str}

A piece is the token's text, or the list of its bytes where they are not whole UTF-8 characters
(a byte-fallback token, or part of a character split over tokens). /apply-template renders the
messages as /v1/chat/completions does, with the generation prompt added. Every field is checked:
a 400 names the one at fault."""
import re
from functools import lru_cache

from .openai_api import bad, chat_tokens, decode, field

# SentencePiece's byte-fallback tokens
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def known(body, names):
    if unknown := sorted(k for k in body if k not in names):
        raise bad(f"'{unknown[0]}' is not a field of this endpoint (it takes "
                  f"{', '.join(repr(n) for n in names)})", unknown[0])


@lru_cache(maxsize=1)
def byte_level_chars():
    """GPT-2's byte-level alphabet: the character that stands for each byte in a token's name."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer, token_id):
    """The bytes a token stands for, read from its name (None where its form is not known)."""
    name = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(name, str):
        return None
    if m := BYTE_TOKEN.fullmatch(name):
        return bytes([int(m[1], 16)])
    chars = byte_level_chars()
    if name and all(c in chars for c in name):
        return bytes(chars[c] for c in name)
    return None


def pieces(tokenizer, ids):
    """Each token's text as it reads after another token (a decoder drops the space that begins
    a text), or its bytes where they are not whole characters."""
    anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
    before = decode(tokenizer, anchor)
    out = []
    for i in ids:
        text = decode(tokenizer, anchor + [i])
        piece = text[len(before):] if text.startswith(before) else decode(tokenizer, [i])
        if ("\ufffd" in piece or not piece) and (raw := token_bytes(tokenizer, i)) is not None:
            try:
                piece = raw.decode()
            except UnicodeDecodeError:
                piece = list(raw)
        out.append({"id": i, "piece": piece})
    return out


def tokenize(body, tokenizer, vocab):
    known(body, ("content", "add_special", "with_pieces"))
    content = body.get("content")
    if not isinstance(content, str):
        raise bad("'content' must be a string: the text to tokenize", "content")
    special = field(body, "add_special", bool, False, need="true or false")
    with_pieces = field(body, "with_pieces", bool, False, need="true or false")
    ids = [int(i) for i in tokenizer.encode(content, add_special_tokens=special)]
    return {"tokens": pieces(tokenizer, ids) if with_pieces else ids}


def detokenize(body, tokenizer, vocab):
    known(body, ("tokens",))
    ids = body.get("tokens")
    if not isinstance(ids, list):
        raise bad("'tokens' must be a list of token ids", "tokens")
    for n, i in enumerate(ids):
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab:
            raise bad(f"'tokens'[{n}] is {i!r}: a token id must be an integer from 0 to "
                      f"{vocab - 1}", "tokens")
    return {"content": decode(tokenizer, ids)}


def apply_template(body, tokenizer, vocab):
    known(body, ("messages",))
    return {"prompt": chat_tokens(body, tokenizer, tokenize=False)}


# path -> handler(body, tokenizer, vocab) -> the answer's JSON
ROUTES = {"/tokenize": tokenize, "/detokenize": detokenize, "/apply-template": apply_template}
