"""One batched decode step on the device: the slots' compiled step queued, its rows' logits
processors and samplers applied, and the tokens (greedy rows by the step's argmax) left on the
device for the step after; and the draws of the rows under a grammar (Draws).

A row under a grammar (Request.constraint) samples nothing in queue_step: its mask for a step's
log-probabilities needs its token before on the host, and the engine queues each step before it
reads the one before. So its token is drawn later (Draws.draw), masked, from the log-probabilities
kept: the mask is computed on a thread (llguidance's work, the GIL let go) from the moment its
token before is read, while the engine delivers that step's tokens and queues the next. The next
step waits for the mask while the device should still be busy with the step before (the engine's
estimate: the fastest recent step period since that step's read); past that the row sits the step
out (Slots.decode's held: its position stays, its output is thrown away) and joins the step after
with its drawn token, so the free rows' steps never wait for a grammar. Where every row would sit
out, or the engine must step alike on every rank (hold off), the step waits for the masks."""
import threading
import time
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import constraints


class Queued(NamedTuple):
    """A queued decode step: the rows whose tokens it draws [(slot, request)] (rows under a
    grammar apart: Draws), its tokens (slots,) and the log-probabilities (slots, vocab) they were
    drawn from."""
    rows: list
    tokens: mx.array
    logprobs: mx.array


def queue_step(s, live, draws):
    """Queue one decode step of the live rows (Slots.live()) of slots s; its tokens feed the
    step after. The rows whose draw is pending (draws) sit it out; those under a grammar that take
    part leave their log-probabilities to draws."""
    # a row fed its prompt samples nothing
    held = frozenset(i for i, r in live if r in draws.pending)
    rows = [(i, r) for i, r in live if not (s.feeding(i) or i in held)]
    raw = sampled = False
    constrained = []
    for i, r in rows:
        r.queued += 1
        raw = raw or bool(r.logits_processors)
        if r.constraint is not None:
            constrained.append((i, r))
        else:
            sampled = sampled or not r.greedy
    out, tokens = s.decode(logits=raw, held=held)
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
    draws.queued(constrained, logprobs)
    if constrained:
        rows = [(i, r) for i, r in rows if r.constraint is None]
    return Queued(rows, tokens, logprobs)


class Draws:
    """The rows under a grammar between the step that computed their log-probabilities and the
    draw of their token from them (the module's note). hold: whether a row whose mask is not done
    may sit the next step out (else the step waits for it). The masks are computed on one thread,
    every row asked for since its last call in one llguidance call; it ends after IDLE seconds
    with nothing to do."""

    IDLE = 1.0

    def __init__(self, hold=True):
        self.hold = hold
        self.pending = {}  # request -> (its step's logprobs, its row there): awaiting its draw
        self.unread = set()  # requests whose last drawn token is not read (their grammar waits)
        # (rows [(slot, request)], tokens (k,), logprobs (k, vocab): the model's, unmasked): to read
        self.drawn = []
        # shared with the thread, under lock: the requests whose masks it computes next, those
        # asked for and not done, and the done ones: request -> (the call's array, its row)
        self.lock = threading.Condition()
        self.todo, self.asked, self.masks = [], set(), {}
        self.thread = None
        self.seconds = 0.0  # host time of the masks (the thread's) and the draws, since spent()

    def spent(self):
        """The host seconds of the masks and the draws since the last call."""
        with self.lock:
            seconds, self.seconds = self.seconds, 0.0
        return seconds

    def queued(self, rows, logprobs):
        """rows [(slot, request)] under a grammar took part in a step queued with logprobs: each
        awaits its draw from its row; the masks of those whose grammar has taken every token
        drawn (a first token) are asked for now, the others' once their token before is read."""
        for i, r in rows:
            self.pending[r] = (logprobs, i)
        self._ask([r for _, r in rows if r not in self.unread])

    def read(self, requests):
        """Their drawn tokens were read (their grammars took them): the masks of those awaiting
        a draw are asked for."""
        self.unread.difference_update(requests)
        self._ask([r for r in requests if r in self.pending])

    def forget(self, r):
        """r left the batch."""
        self.pending.pop(r, None)
        self.unread.discard(r)
        with self.lock:
            self.asked.discard(r)
            self.masks.pop(r, None)
            if r in self.todo:
                self.todo.remove(r)

    def clear(self):
        """Drop every row (after a failed step)."""
        self.pending, self.unread, self.drawn = {}, set(), []
        with self.lock:
            self.todo, self.asked, self.masks = [], set(), {}

    def _ask(self, requests):
        if not requests:
            return
        with self.lock:
            self.todo += requests
            self.asked.update(requests)
            if self.thread is None:
                self.thread = threading.Thread(target=self._work, name="grammar-masks",
                                               daemon=True)
                self.thread.start()
            self.lock.notify_all()

    def _work(self):
        """(the thread) Every mask asked for, in one call at a time: bitmasks (rows, words)
        (constraints.words); a failure is handed to the draw."""
        while True:
            with self.lock:
                if not self.todo:
                    self.lock.wait(self.IDLE)
                if not self.todo:
                    self.thread = None
                    return
                todo, self.todo = self.todo, []
            began = time.perf_counter()
            try:
                out = constraints.words([r.constraint for r in todo])
            except Exception as e:  # (raised where the draw takes it)
                out = e
            with self.lock:
                for j, r in enumerate(todo):
                    if r in self.asked:
                        self.asked.discard(r)
                        self.masks[r] = (out, j)
                self.seconds += time.perf_counter() - began
                self.lock.notify_all()

    def draw(self, s, live, hold=True, until=None):
        """Before a step of slots s is queued: draw the tokens of its live rows whose masks are
        done into s.tokens, the step's input, their masks waited for until `until` (perf_counter
        seconds; None: not at all); all of them, waiting for every mask, with hold off (here: no
        step follows; or the Draws') or where no live row would take part in the step without
        them. They are read with the step read next (taken)."""
        if not self.pending:
            return
        sit_out = self.hold and hold and any(r not in self.pending for _, r in live)
        with self.lock:
            wanted = [r for r in self.pending if r in self.masks or r in self.asked]
            done = (lambda: not any(r in self.asked for r in wanted))
            if not sit_out:
                self.lock.wait_for(done)
            elif until is not None and (left := until - time.perf_counter()) > 0:
                self.lock.wait_for(done, timeout=left)
            waiting = [r for r in wanted if r in self.masks]
            masks = {r: self.masks.pop(r) for r in waiting}
        if not waiting:
            return
        began = time.perf_counter()
        groups = {}  # the steps their log-probabilities come from (most often one)
        for r in waiting:
            table, i = self.pending.pop(r)
            groups.setdefault(id(table), (table, [], []))
            groups[id(table)][1].append(i)
            groups[id(table)][2].append(r)
        waiting = [r for _, _, rs in groups.values() for r in rs]
        logprobs = mx.concatenate([t[mx.array(at)] for t, at, _ in groups.values()])
        masks = [masks[r] for r in waiting]
        for out, _ in masks:
            if isinstance(out, Exception):
                raise out
        first = masks[0][0]
        if all(out is first and j == k for k, (out, j) in enumerate(masks)):
            masks = first[:len(masks)]  # (the rows of one call, in its order)
        else:
            masks = np.stack([out[j] for out, j in masks])
        rows = [(r.slot, r) for r in waiting]
        allowed = constraints.allowed(masks, waiting[0].constraint.vocab)
        masked = mx.where(allowed, logprobs, mx.array(-mx.inf, logprobs.dtype))
        drawn = mx.argmax(masked, axis=-1)
        if not all(r.greedy for r in waiting):
            drawn = mx.concatenate([drawn[j:j + 1] if r.greedy
                                    else r.sample(masked[j:j + 1]).reshape(1)
                                    for j, r in enumerate(waiting)])
        drawn = drawn.astype(s.tokens.dtype)
        tokens = s.tokens
        tokens[mx.array([i for i, _ in rows])] = drawn
        for j, (i, r) in enumerate(rows):
            if r.logits_processors:
                r.seen = mx.concatenate([r.seen, drawn[j:j + 1].astype(r.seen.dtype)])
        s.tokens = tokens
        mx.async_eval(tokens, drawn)
        self.drawn.append((rows, drawn, logprobs))
        self.unread.update(waiting)
        with self.lock:
            self.seconds += time.perf_counter() - began

    def taken(self):
        """The draws to read (emptied)."""
        drawn, self.drawn = self.drawn, []
        return drawn


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
