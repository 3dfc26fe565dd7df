"""One batched decode step on the device: the slots' compiled step queued, its rows' logits
processors and samplers applied, and the tokens (greedy rows by the step's argmax) left on the
device for the step after.

A row under a grammar (Request.constraint) samples nothing in queue_step: its mask for step n
needs its token of step n-1 on the host, and the engine queues step n before reading step n-1. So
settle() draws its token from step n's log-probabilities, masked, once step n-1 is read and before
step n+1 is queued: the host computes the mask while the device runs step n, and the step stays
queued ahead for every row. A batch without such a row runs as before (settle returns at once);
with one, the other rows' tokens are computed as without it, and the step after waits on the
masked rows' draws (a few small operations after the step)."""
from typing import NamedTuple

import mlx.core as mx

from .. import constraints


class Queued(NamedTuple):
    """A queued decode step: the rows it decodes [(slot, request)], its tokens (slots,) and the
    log-probabilities (slots, vocab) they were drawn from."""
    rows: list
    tokens: mx.array
    logprobs: mx.array
    constrained: list = ()  # its rows under a grammar [(slot, request)], drawn by settle


def queue_step(s, live):
    """Queue one decode step of the live rows (Slots.live()) of slots s; its tokens feed the
    step after."""
    # a row fed its prompt samples nothing
    rows = [(i, r) for i, r in live if not s.feeding(i)] if s.feed else live
    raw = sampled = False
    constrained = []
    for i, r in rows:
        r.queued += 1
        raw = raw or bool(r.logits_processors)
        if r.constraint is not None:
            constrained.append((i, r))
        else:
            sampled = sampled or not r.greedy
    out, tokens = s.decode(logits=raw)
    logprobs = out
    if raw:
        logprobs = log_softmax(process(out, rows))
        tokens = mx.argmax(logprobs, axis=-1)
    if sampled:
        sampled = [(i, r) for i, r in rows if not (r.greedy or r.constraint)]
        drawn = [r.sample(logprobs[i:i + 1]).reshape(1) for i, r in sampled]
        tokens[mx.array([i for i, _ in sampled])] = mx.concatenate(drawn).astype(tokens.dtype)
    if raw:
        for i, r in rows:
            if r.logits_processors and not r.constraint:
                r.seen = mx.concatenate([r.seen, tokens[i:i + 1].astype(r.seen.dtype)])
    s.tokens = tokens
    mx.async_eval(tokens, logprobs)
    return Queued(rows, tokens, logprobs, constrained)


def settle(s, step):
    """Draw the tokens of a queued step's rows under a grammar (still in the batch), each from its
    masked log-probabilities, into the step's tokens (the next step's input); their grammars have
    taken every token before (the step before was read). Returns the step."""
    if not step.constrained:
        return step
    rows = [(i, r) for i, r in step.constrained if r.slot is not None]
    if not rows:
        return step
    # every row's mask in one llguidance call and a few device operations (constraints.words)
    at = mx.array([i for i, _ in rows])
    logprobs = step.logprobs[at]
    logprobs = mx.where(constraints.allowed_rows([r.constraint for _, r in rows]), logprobs,
                        mx.array(-mx.inf, logprobs.dtype))
    drawn = mx.argmax(logprobs, axis=-1)
    if not all(r.greedy for _, r in rows):
        drawn = mx.concatenate([drawn[j:j + 1] if r.greedy
                                else r.sample(logprobs[j:j + 1]).reshape(1)
                                for j, (_, r) in enumerate(rows)])
    tokens = step.tokens
    tokens[at] = drawn.astype(tokens.dtype)
    for i, r in rows:
        if r.logits_processors:
            r.seen = mx.concatenate([r.seen, tokens[i:i + 1].astype(r.seen.dtype)])
    s.tokens = tokens
    mx.async_eval(tokens)
    return step


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
