"""Constrained decoding: a grammar (a JSON schema, any JSON object, a Lark grammar) that every
generated token must follow, through llguidance.

A grammar is llguidance's grammar text (`schema_grammar`, `JSON_OBJECT`, `lark_grammar`), checked
by `check` without a tokenizer (the server's 400). A `Constraint` is one generation's state of it:
`allowed()` the tokens the grammar takes next (a boolean mask over the model's vocabulary,
computed on the host), `accept(token)` after each generated token. Where the grammar is complete
only the end-of-sequence tokens are allowed, so a finished JSON text ends the generation; a stop
token is allowed only where the grammar accepts.

llguidance's tokenizer is built once per tokenizer from its Hugging Face fast tokenizer (the
GGUF's tokenizer is one) and kept on it: the first constrained request pays for that. So is a
grammar's matcher, compiled once per grammar text and tokenizer (`matcher`): a request under a
grammar seen before takes a copy of it, not a compilation on the engine's thread."""
import json
import threading
from collections import OrderedDict
from functools import lru_cache

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np

JSON_OBJECT = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
_LOCK = threading.Lock()
KEPT_GRAMMARS = 64  # compiled matchers kept per tokenizer (the least recently used go first)


def schema_grammar(schema):
    """The grammar of the JSON texts that a JSON schema (a dict, or its JSON text) accepts; a
    ValueError for a text that is not JSON."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    return llguidance.LLMatcher.grammar_from_json_schema(schema)


def lark_grammar(lark):
    """The grammar of a Lark grammar's text (llguidance's dialect: `%json {schema}` inside it)."""
    return llguidance.LLMatcher.grammar_from_lark(lark)


def check(grammar):
    """What is wrong with a grammar ("" if nothing), without a tokenizer."""
    return llguidance.LLMatcher.validate_grammar(grammar)


def hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer inside mlx-lm's TokenizerWrapper (or the one given)."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def ll_tokenizer(tokenizer, vocab):
    """llguidance's tokenizer for `tokenizer` (mlx-lm's or Hugging Face's) over a vocabulary of
    `vocab` ids (the model's logits), its end-of-sequence tokens mlx-lm's eos_token_ids; built once
    and kept on the tokenizer."""
    with _LOCK:
        kept = getattr(tokenizer, "_llguidance", None)
        if kept is None or kept[0] != vocab:
            eos = sorted(getattr(tokenizer, "eos_token_ids", None) or ()) or None
            kept = (vocab, llguidance.hf.from_tokenizer(hf_tokenizer(tokenizer), n_vocab=vocab,
                                                        eos_token=eos))
            tokenizer._llguidance = kept
            tokenizer._llguidance_matchers = OrderedDict()  # grammar -> its fresh LLMatcher
        return kept[1]


def matcher(grammar, tokenizer, vocab):
    """A fresh llguidance matcher of grammar over ll_tokenizer(tokenizer, vocab): a copy of one
    compiled at the grammar's first use and kept on the tokenizer (KEPT_GRAMMARS of them): the
    batch worker builds a request's constraint on the engine's thread, between two steps, and a
    compilation costs it far more host time than a copy (bench/probes/constrained_steps.py,
    build)."""
    ll = ll_tokenizer(tokenizer, vocab)
    with _LOCK:
        kept = tokenizer._llguidance_matchers
        fresh = kept.get(grammar)
        if fresh is None:
            fresh = llguidance.LLMatcher(ll, grammar, log_level=0)
            if fresh.is_error():  # (not kept: Constraint raises)
                return fresh
            kept[grammar] = fresh
            while len(kept) > KEPT_GRAMMARS:
                kept.popitem(last=False)
        kept.move_to_end(grammar)
        return fresh.deep_copy()


class Constraint:
    """One generation under a grammar: allowed() the tokens it takes next, accept(token) each
    token generated. A grammar the matcher cannot build raises ValueError."""

    def __init__(self, grammar, tokenizer, vocab):
        self.vocab = vocab
        self.matcher = matcher(grammar, tokenizer, vocab)
        if self.matcher.is_error():
            raise ValueError(f"the grammar is not valid: {self.matcher.get_error()}")
        self.eos = sorted(getattr(tokenizer, "eos_token_ids", None) or ())

    def allowed(self):
        """(vocab,) booleans: the tokens the grammar takes next (allowed_rows' row, unpacked on the
        host)."""
        return mx.array(unpacked(words([self]), self.vocab)[0])

    def mask(self, logprobs):
        """logprobs (1, vocab) with the tokens the grammar refuses at -inf."""
        return mx.where(allowed_rows([self]), logprobs, mx.array(-mx.inf, logprobs.dtype))

    def accept(self, token):
        """The grammar takes a generated token (an end-of-sequence token ends it)."""
        self.matcher.consume_token(token)

    @property
    def done(self):
        """Whether the grammar takes nothing more but the end of the sequence."""
        return self.matcher.is_stopped()


def words(constraints):
    """llguidance's bitmasks of the constraints (one vocabulary), a bit per token, as (rows,
    words) int32: computed together on llguidance's threads (a batch's rows in one call, not one
    Python call and one host array each). A matcher that failed (a limit of llguidance's) allows
    only the end-of-sequence tokens, ending its generation."""
    vocab = constraints[0].vocab
    out = np.zeros((len(constraints), -(-vocab // 32)), np.int32)
    live = [(c.matcher, j) for j, c in enumerate(constraints) if not c.matcher.is_error()]
    if len(live) == 1:  # (the threads' hand-off costs one row more than it saves)
        live[0][0].unsafe_compute_mask_ptr(out[live[0][1]].ctypes.data, out[0].nbytes)
    elif live:
        llguidance.numpy.fill_next_token_bitmask_par(_executor(), live, out)
    bits = out.view(np.uint32)
    for j, c in enumerate(constraints):
        if c.matcher.is_error():
            bits[j] = 0
            for t in (t for t in c.eos if t < vocab):
                bits[j, t // 32] |= np.uint32(1 << (t % 32))
    return out


def allowed_rows(constraints):
    """(rows, vocab) booleans, row j the tokens constraints[j]'s grammar takes next."""
    return allowed(words(constraints), constraints[0].vocab)


def allowed(bitmasks, vocab):
    """(rows, vocab) booleans of words' (rows, words) int32 bitmasks: on a GPU they go over as
    they are, a bit a token, and are unpacked there; on the CPU numpy unpacks them (MLX's gather
    and shifts cost it far more: bench/LOG.md, "Thirty-sixth pass, on this CPU after the device
    time was spent")."""
    if mx.default_device() == mx.gpu:
        return unpack(mx.array(bitmasks), vocab)
    return mx.array(unpacked(bitmasks, vocab))


def unpack(words, vocab):
    """(rows, vocab) booleans of (rows, words) int32 bitmasks, on the default device."""
    word, bit = _bit_table(vocab)
    return (mx.take(words, word, axis=1) >> bit) & 1 == 1


@lru_cache(maxsize=4)
def _bit_table(vocab):
    ids = mx.arange(vocab, dtype=mx.int32)
    return ids // 32, ids % 32


def unpacked(bitmasks, vocab):
    """(rows, vocab) numpy booleans of (rows, words) int32 bitmasks."""
    bits = np.unpackbits(bitmasks.view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab].view(bool)


def _executor():
    global _EXECUTOR
    with _LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR


_EXECUTOR = None
