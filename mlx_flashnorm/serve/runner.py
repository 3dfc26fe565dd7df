"""One batched decode step on the device: the slots' compiled step queued, its rows' logits
processors and samplers applied, and the tokens (greedy rows by the step's argmax) left on the
device for the step after."""
from typing import NamedTuple

import mlx.core as mx


class Queued(NamedTuple):
    """A queued decode step: the rows it decodes [(slot, request)], its tokens (slots,) and the
    log-probabilities (slots, vocab) they were drawn from."""
    rows: list
    tokens: mx.array
    logprobs: mx.array


def queue_step(s, live):
    """Queue one decode step of the live rows (Slots.live()) of slots s; its tokens feed the
    step after."""
    # a row fed its prompt samples nothing
    rows = [(i, r) for i, r in live if not s.feeding(i)] if s.feed else live
    raw = sampled = False
    for i, r in rows:
        r.queued += 1
        raw = raw or bool(r.logits_processors)
        sampled = sampled or not r.greedy
    out, tokens = s.decode(logits=raw)
    logprobs = out
    if raw:
        logprobs = log_softmax(process(out, rows))
        tokens = mx.argmax(logprobs, axis=-1)
    if sampled:
        sampled = [(i, r) for i, r in rows if not r.greedy]
        drawn = [r.sample(logprobs[i:i + 1]).reshape(1) for i, r in sampled]
        tokens[mx.array([i for i, _ in sampled])] = mx.concatenate(drawn).astype(tokens.dtype)
    if raw:
        for i, r in rows:
            if r.logits_processors:
                r.seen = mx.concatenate([r.seen, tokens[i:i + 1].astype(r.seen.dtype)])
    s.tokens = tokens
    mx.async_eval(tokens, logprobs)
    return Queued(rows, tokens, logprobs)


def process(logits, rows):
    """Each row's logits processors (penalties), given its tokens so far."""
    ruled = [(i, r) for i, r in rows if r.logits_processors]
    out = []
    for i, r in ruled:
        row = logits[i:i + 1]
        for p in r.logits_processors:
            row = p(r.seen, row)
        out.append(row)
    logits[mx.array([i for i, _ in ruled])] = mx.concatenate(out).astype(logits.dtype)
    return logits


def log_softmax(logits):
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
