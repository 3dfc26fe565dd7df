"""Continuous batching: many requests decoded together, one model call per step for all of them.

A request joins the running batch at any step and leaves it when it finishes, each with its own
sampling (temperature, top-p, min-p, top-k, seed, logits processors), stop tokens and max_tokens. A
newcomer that arrives while rows decode, with at most `feed` prompt tokens past its cached prefix,
takes a slot at once and is fed those tokens through the batch's decode steps, one a step,
sampling nothing until its last: a prefill call would hold every running row for its length
(the time of many steps: bench/RESULTS.md, "Serving"), a fed token costs the step nothing it
does not already pay. But a fed newcomer waits a step a token: where steps are slow
(the CPU, where a step's time grows with its rows) `feed_wait` bounds that wait by the fastest
recent step (bench/RESULTS.md, "Serving"). Other prompts are prefilled (mlx-lm's KVCache) in
chunks of at most `prefill_step` tokens per engine step, between the others' decode steps, so a
long prompt delays the running streams by one chunk a step rather than by its whole length; the
prompts with the fewest tokens left go first (a short newcomer is not held behind a long prompt's
chunks), and each step waits for the chunks the last one queued, so that a newcomer or a
cancellation waits behind one chunk on the device, not all of a long prompt's;
newcomers that arrive together and fit the step whole share one call (rows padded at their ends,
each from the shortest of their cached prefixes). Once only its last token is left it takes a slot
of the batch's static cache (slots.Slots: one buffer per layer, a slot per row, each row at
its own position) and the compiled batched step decodes it with the others: one compiled call and
one argmax for the greedy rows (sampled rows and logits processors add operations), the host's
other work small for each row (bench/RESULTS.md, "Serving").
A prompt cache (prompt_cache.py) spares a newcomer the prefix an earlier request already read. So
does a free slot: it keeps what its last row read, and a newcomer sharing a prefix with it takes it
with no copy (fed the rest); the slots outlive an idle moment, and where a lone request at an idle
engine runs the one-request step, or a batch shrinks, the wave's slots wait aside for the next.
What a slot kept goes to the prompt cache only before the slot is taken or its buffers rebuilt, or
once the engine idles (_release).
A request of n choices (Request.twins: the others) is prefilled once, alone (neither fed nor
sharing a call), and its cache copied into n slots as it joins: each row then runs the last prompt
token and draws its own tokens.

Pipelining, as generate_step: step n+1 is queued (mx.async_eval) before step n's tokens are read,
its input the tokens step n samples on the device. A row that finishes at step n is noticed when
step n is read, so step n+1 computed one token too many for it (thrown away); a newcomer joins the
step queued after it was prefilled. A row under a grammar draws each token late, its mask computed
on a thread once its token before is read, and sits a step out where the mask is not done when the
step is queued (runner.Draws): the step stays queued ahead for the other rows.

Exactness: every row's result is the one-request computation (a norm's deferred 1/RMS is per row),
up to the summation order of a batched matmul and of attention over the whole capacity (masked
positions count zero). On CUDA a step of several rows is one kernel (kernels.decode_rows, its
matvecs on the tensor cores: another summation order, so a greedy token may differ from the
one-request token only where two tokens tie); elsewhere the plain composition of MLX operations; a
bucket of one slot runs the one-request compiled step.

The engine is synchronous (BatchEngine.step); batch_worker.BatchWorker runs one on its own thread
for the server."""
import time
from collections import deque
from typing import List, NamedTuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .. import forms
from ..decoding import cache_capacity, context_length, prefill
from .prompt_cache import common_prefix
from .requests import Load
from .runner import Draws, queue_step
from .sequence import Event, Request
from .slots import (Slots, bucket, kv_layout, need, needed_capacity, one_row_cache, rows_of,
                    token_bytes)


# steps the rows fit a smaller bucket before it is taken: a wave that ended shrank the batch to one
# row and grew it again within a few steps, copying every row's cache each time
# (bench/RESULTS.md, "Serving")
SHRINK_AFTER = 32


class Filling(NamedTuple):
    """A request under prefill: its one-row caches (empty until its first chunk or its join needs
    them: BatchEngine._caches), the prompt tokens still to run, and where its cached prefix is
    (a prompt_cache.Block and its row there; None: nothing cached)."""
    request: Request
    cache: list
    todo: List[int]
    prefix: tuple = None


class Joining(NamedTuple):
    """A request waiting for its slot: its row of kv ([(keys, values)] per layer, one row for each
    request prefilled with it, in order; none: nothing cached) holds its first `length` positions,
    and its slot feeds the tokens `feed` next (its last prompt token; every one past its cached
    prefix where fed)."""
    request: Request
    kv: list
    length: int
    feed: list


FEED_WAIT = 0.1  # seconds: the server's bound on a fed newcomer's wait (BatchEngine's feed_wait)


class BatchEngine:
    """Prefills newcomers and decodes the running batch, one step() at a time.

    max_batch: requests decoded together at most (more wait their turn). prefill_step: prompt
    tokens prefilled per step at most. feed: a newcomer arriving while rows decode is fed its
    prompt through the decode steps where at most this many tokens are left past its cached prefix
    (0: never), and, with feed_wait (seconds; None: no bound), only where that many steps at the
    fastest of the last few steps' periods (between step() calls that read a step, no prefill call
    in it) take at most feed_wait. prompt_cache: a PromptCache, or None. prefilled counts the
    prompt tokens the model computed (cache hits excluded; fed ones included), prefill_calls the
    model calls that prefilled (newcomers arriving together share one: _prefill_together). The
    batch is a slots.Slots (self.slots, None while empty) of bucket(rows) slots: more rows
    grow it, few rows for more than SHRINK_AFTER steps shrink it (to a quarter, or one row: the
    one-request compiled step, `solo`), its larger slots set aside (spare) for the next wave.
    kv_budget: bytes the batch's slots may take, those set aside with them (None: no bound): a
    request waits until the batch with it fits, each row at the capacity of the longest (its
    prompt and max_tokens). The batch is sized for every request taken in (those still under
    prefill too), so that a burst prefilled over several steps grows it once: a bucket grown
    copies every live row into the new buffers, a row joining inside its bucket copies none.
    hold: a row under a grammar whose mask is not done sits a step out rather than the step
    waiting for it (runner.Draws; off where every rank of mlx.launch must take the same steps)."""

    def __init__(self, model, max_batch=32, prefill_step=2048, prompt_cache=None, feed=32,
                 feed_wait=None, kv_budget=None, hold=True):
        self.model, self.max_batch, self.prefill_step, self.feed = (
            model, max_batch, prefill_step, feed)
        self.kv_budget = kv_budget
        self.feed_wait, self.periods, self.read_at = feed_wait, deque(maxlen=64), None
        self.prompt_cache = prompt_cache
        self.waiting = deque()
        self.filling = []
        self.joining = []  # Joining: prefilled, taking a slot next step
        self.slots = None
        self.spare = None  # the slots a lone newcomer or a shrink left, kept for the next wave
        self.idle = True  # no row decoded when this step began
        self.pending = None  # the runner.Queued step not read yet
        self.draws = Draws(hold)  # the rows under a grammar awaiting their draws
        # prefill calls as arrays to wait for: this step's, and the last step's (waited for in this)
        self.queued, self.in_flight = [], []
        self.layout = None  # slots.kv_layout, read once
        self.prefilled = 0
        self.prefill_calls = 0
        # the other counters of load(): read steps, the rows they read, tokens generated, prompt
        # tokens the prompt cache gave, and requests' prefill and choices' generation seconds
        self.steps = self.rows_stepped = self.generated = self.cached_tokens = 0
        self.prompt_seconds = self.generation_seconds = 0.0
        self.mask_seconds = 0.0  # host time of the constrained rows' masks and draws (Draws)
        self.small = 0  # steps in a row that a smaller bucket would have held the rows

    COUNTERS = ("prefilled", "prefill_calls", "steps", "rows_stepped", "generated",
                "cached_tokens", "prompt_seconds", "generation_seconds", "mask_seconds")

    def add(self, request):
        """Queue a request; max_tokens is cut to what the model's context leaves."""
        room = context_length(self.model) - len(request.tokens)
        if not request.tokens or room < 1:
            raise ValueError(f"a prompt of {len(request.tokens)} tokens does not fit the model's "
                             f"context of {context_length(self.model)}")
        request.max_tokens = min(request.max_tokens, room)
        for t in request.twins:
            t.max_tokens = request.max_tokens
        rows = 1 + len(request.twins)
        if self.kv_budget is not None and self._nbytes(rows, need(request)) > self.kv_budget:
            raise ValueError(f"a prompt of {len(request.tokens)} tokens and max_tokens "
                             f"{request.max_tokens} need {self._nbytes(rows, need(request))} "
                             f"bytes of KV cache ({rows} rows), more than the budget of "
                             f"{self.kv_budget}")
        self.waiting.append(request)

    @property
    def rows(self):
        """The requests in the batch, in slot order."""
        return [r for r in self.slots.rows if r is not None] if self.slots is not None else []

    @property
    def solo(self):
        """Whether the batch runs the one-request compiled step (a bucket of one slot)."""
        return bool(self.rows) and self.slots.solo

    @property
    def busy(self):
        return bool(self.waiting or self.filling or self.joining or self.rows)

    def load(self):
        """requests.Load: the counters, and the batch's rows and cache now (waiting: with every
        choice a row; the cache's room: the positions kv_budget holds, or the slots' without
        one)."""
        s, rows = self.slots, self.rows
        return Load(self.prefilled, self.cached_tokens, self.prompt_seconds, self.generated,
                    self.generation_seconds, self.steps + self.prefill_calls, self.steps,
                    self.rows_stepped, len(rows), self._admitted(),
                    sum(1 + len(r.twins) for r in self.waiting),
                    sum(s.pos[r.slot] for r in rows),
                    self.kv_budget // token_bytes(self._layout()) if self.kv_budget is not None
                    else s.size * s.capacity if s else 0, mask_seconds=self.mask_seconds)

    def _admitted(self):
        """Rows taken: in the batch, joining it, or under prefill (with their twins)."""
        return (len(self.rows) + len(self.joining)
                + sum(1 + len(f.request.twins) for f in self.filling))

    def requests(self):
        """Every request added and not finished: waiting, under prefill or in the batch."""
        return (list(self.waiting) + [f.request for f in self.filling]
                + [j.request for j in self.joining] + self.rows)

    def clear(self):
        """Drop every request (after a failed step)."""
        self.waiting, self.filling, self.joining, self.slots, self.pending = (
            deque(), [], [], None, None)
        self.spare = self.read_at = None
        self.queued, self.in_flight = [], []
        self.draws.clear()

    def step(self):
        """Drop cancelled requests, prefill up to prefill_step prompt tokens, give the prefilled
        newcomers slots, queue the next decode step, and read the one queued before it. Returns
        that step's Events (one per row it decoded that is still in the batch)."""
        self._drop_cancelled()
        calls = self.prefill_calls
        self._prefill()
        self._place()
        # (the rows' host work is per row: once a step)
        live = self.slots.live() if self.slots is not None else []
        if self.pending is None and live:
            self.pending = queue_step(self.slots, live, self.draws)
        if self.pending is None:
            return []
        more = any(r.queued < r.max_tokens for _, r in live)
        # rows under a grammar: the draws whose masks are done (all where no step follows), those
        # waited for while the device should still be busy with the step queued before
        busy = (self.read_at + min(self.periods) if self.read_at is not None and self.periods
                else None)
        self.draws.draw(self.slots, live, hold=more, until=busy)
        ahead = queue_step(self.slots, live, self.draws) if more else None
        events = self._read(self.pending)
        self.pending = ahead if (left := self.rows) else None
        self.mask_seconds += self.draws.spent()
        now = time.perf_counter()
        if self.read_at is not None and calls == self.prefill_calls:
            self.periods.append(now - self.read_at)
        self.read_at = now if self.pending is not None else None
        # idle: what the slots kept goes to the prompt cache
        if not left and not self.busy and self.slots is not None:
            self.slots.store(self.prompt_cache)
        return events

    def feedable(self, n):
        """Whether a newcomer with n prompt tokens left is fed them through the decode steps."""
        return n <= self.feed and (self.feed_wait is None or not self.periods
                                   or n * min(self.periods) <= self.feed_wait)

    def _drop_cancelled(self):
        self.waiting = deque(r for r in self.waiting if not r.cancelled)
        self.filling = [f for f in self.filling if not f.request.cancelled]
        self.joining = [j for j in self.joining if not j.request.cancelled]
        self._release([r for r in self.rows if r.cancelled])

    def _prefill(self):
        decoding, fed = bool(self.rows), []
        self.idle = not decoding
        s = self.spare
        # growing: into the slots set aside, with what they kept
        if s is not None and self.waiting and len(self.rows) + len(self.waiting) > self.slots.size:
            s.store(self.prompt_cache)  # (rows cancelled as the lone one came left theirs in it)
            if not self.rows or needed_capacity(self.model, self.rows) <= s.capacity:
                self.slots.store(self.prompt_cache)
                self._renumber(self.slots.moved(s))  # with what they kept
            self.spare = None
        count = longest = 0
        if self.waiting:  # (a step with none waiting adds no host work per row)
            taken = (self.rows + [f.request for f in self.filling]
                     + [j.request for j in self.joining])
            count = len(taken) + sum(len(f.request.twins) for f in self.filling)
            longest = max(map(need, taken), default=0)
        # (a request takes a row for each of its choices)
        while (self.waiting and count + 1 + len(self.waiting[0].twins) <= self.max_batch
               and self._fits(count + 1 + len(self.waiting[0].twins),
                              max(longest, need(self.waiting[0])))):
            r = self.waiting.popleft()
            r.began = time.perf_counter()
            count, longest = count + 1 + len(r.twins), max(longest, need(r))
            n, block, row = self.prompt_cache.find(r.tokens) if self.prompt_cache else (0, None, 0)
            reusable = self.slots is not None and self.prompt_cache is not None
            slot, kept = self.slots.reuse(r.tokens) if reusable else (None, 0)
            if (slot is not None and self.feedable(len(r.tokens) - kept) and (kept >= n or decoding)
                    and not r.twins):
                # its prefix is in a free slot (or nearly, while rows decode: feeding a few more
                # tokens costs less than a copy)
                self._take(r, slot, kept)
                continue
            # its prefix, for the find
            if slot is not None and slot in self.slots.unstored and kept > n:
                self.slots.store(self.prompt_cache)
                n, block, row = self.prompt_cache.find(r.tokens)
            r.cached = n
            if decoding and self.feedable(len(r.tokens) - n) and not r.twins:
                fed.append((r, block, row))  # fed through the decode steps: nobody waits for it
            else:
                # (its caches built only where it runs alone: a copy a layer and newcomer cost a
                # wave prefilled in shared calls much host time)
                self.filling.append(Filling(r, [], list(r.tokens[n:-1]), (block, row) if n
                                            else None))
        self._feed(fed)
        self.queued = []
        together = self._prefill_together()
        budget = self.prefill_step - together
        # the fewest tokens left first: a short prompt is not held behind a long one's chunks
        for f in sorted(self.filling, key=lambda f: len(f.todo)):
            if (together and f.todo and not self._begun(f) and len(f.todo) <= self.prefill_step
                    and not f.request.twins):
                continue  # begun now it would go alone; whole, it joins the next step's shared call
            n = min(budget, len(f.todo))
            if n:
                prefill(self.model, f.todo[:n], self._caches(f))
                mx.async_eval([(c.keys, c.values) for c in f.cache])
                # (a slice: the next chunk writes the cache's arrays over, in place)
                self.queued += [c.keys[..., :1, :1] for c in f.cache]
                del f.todo[:n]
                budget -= n
                self.prefilled += n
                self.prefill_calls += 1
            if not f.todo:
                self._join(f)
        # the last step's calls done before this step's return: with no row decoding, nothing else
        # waits, and a long prompt's chunks would all be queued on the device at once, ahead of a
        # newcomer's prefill and past its own cancellation
        if self.in_flight:
            mx.eval(self.in_flight)
        self.in_flight = self.queued

    def _prefill_together(self):
        """Newcomers not begun (nothing run past their cached prefix) whose prompts fit the step's
        budget, prefilled in one model call: on a GPU a call costs its launches more than its
        tokens. Each starts from the shortest cached prefix among them (the longer prefixes' extra
        tokens are computed again: a few), its other tokens padded at their end to the longest, so
        causal attention keeps the padding out of every real position. Returns the tokens the call
        took (padded)."""
        group, longest, start = [], 0, None
        for f in self.filling:
            if self._begun(f) or not f.todo or f.request.twins:
                continue
            c = f.request.cached if start is None else min(start, f.request.cached)
            n = max(longest + (start or 0) - c, len(f.request.tokens) - 1 - c)
            if n * (len(group) + 1) <= self.prefill_step:
                group, longest, start = group + [f], n, c
        if len(group) < 2:
            return 0
        cache = [KVCache() for _ in self.model.layers]
        if start:
            # each distinct prefix copied once, then gathered into its members' rows (a copy a
            # member and layer made the call take many times the model's own time:
            # bench/RESULTS.md, "Serving")
            prefixes = [tuple(f.request.tokens[:start]) for f in group]
            distinct = list(dict.fromkeys(prefixes))
            held = [group[prefixes.index(p)].prefix for p in distinct]  # (its Block, its row)
            row = mx.array([distinct.index(p) for p in prefixes])
            for layer, c in enumerate(cache):
                c.keys, c.values = (mx.concatenate([block.kv[layer][a][j:j + 1, :, :start, :]
                                                    for block, j in held])[row]
                                    for a in (0, 1))
                c.offset = start
        todo = [f.request.tokens[start:-1] for f in group]
        self.model(mx.array([t + [0] * (longest - len(t)) for t in todo]), cache=cache)
        kv = [(c.keys[..., :c.offset, :], c.values[..., :c.offset, :]) for c in cache]
        mx.async_eval(kv)
        self.queued.append(kv)
        for f, t in zip(group, todo):
            self.filling.remove(f)
            f.request.cached = start
            self.prefilled += len(t) + 1  # and the last prompt token, computed in the decode step
            self.joining.append(Joining(f.request, kv, start + len(t), f.request.tokens[-1:]))
        if self.prompt_cache is not None:  # the prefix the group shares, for requests to come (each
            first = group[0].request.tokens[:-1]  # row's own at _release)
            common = min(common_prefix(first, f.request.tokens[:-1]) for f in group[1:])
            if common > start:
                self.prompt_cache.store(first[:common],
                                        [(k[:1, :, :common, :], v[:1, :, :common, :])
                                         for k, v in kv])
        self.prefill_calls += 1
        return longest * len(group)

    def _fits(self, rows, longest):
        """Whether a batch of `rows` rows, the longest writing `longest` positions, fits kv_budget
        beside the slots set aside (dropped, what they kept stored, where only they are in the
        way)."""
        if self.kv_budget is None:
            return True
        size = self._nbytes(rows, longest)
        if self.spare is not None and size + self.spare.nbytes > self.kv_budget >= size:
            self.spare.store(self.prompt_cache)
            self.spare = None
        return size + (self.spare.nbytes if self.spare is not None else 0) <= self.kv_budget

    def _nbytes(self, rows, longest):
        """Bytes of slots for `rows` rows, the longest writing `longest` positions."""
        return bucket(rows) * cache_capacity(self.model, longest) * token_bytes(self._layout())

    @staticmethod
    def _begun(f):
        """Whether a chunk of f's prompt past its cached prefix was run."""
        c = f.cache[0] if f.cache else None
        return c is not None and c.keys is not None and c.offset > f.request.cached

    def _caches(self, f):
        """f's one-row caches, made at their first use: views of its cached prefix (or empty)."""
        if not f.cache:
            n = f.request.cached
            f.cache[:] = ([one_row_cache(k, v) for k, v in f.prefix[0].prefix(f.prefix[1], n)]
                          if n else [KVCache() for _ in self.model.layers])
        return f.cache

    def _feed(self, fed):
        """Newcomers [(request, prompt_cache.Block or None, its row)] to be fed their prompts past
        their cached prefixes: those with a prefix join as one group, their rows of each block
        gathered at once (a copy a row and layer cost a step of many newcomers much host time:
        bench/RESULTS.md, "Serving")."""
        groups = {}  # Block -> [(request, its row there)]
        for r, block, row in fed:
            self.prefilled += len(r.tokens) - r.cached
            if block is None:
                self.joining.append(Joining(r, [], 0, list(r.tokens)))
            else:
                groups.setdefault(block, []).append((r, row))
        if not groups:
            return
        width = max(r.cached for g in groups.values() for r, _ in g)
        index = [(block, mx.array([row for _, row in g])) for block, g in groups.items()]
        kv = [tuple(mx.concatenate([rows_of(block.kv[layer][i], rows, width)
                                    for block, rows in index]) for i in (0, 1))
              for layer in range(len(self.model.layers))]
        for g in groups.values():  # in the order of kv's rows
            for r, _ in g:
                self.joining.append(Joining(r, kv, r.cached, r.tokens[r.cached:]))

    def _take(self, r, slot, n):
        """A newcomer joins at once in a free slot still holding its first n prompt tokens, fed the
        rest (a step's copies for many newcomers cost much host time: bench/RESULTS.md,
        "Serving")."""
        if slot in self.slots.unstored:  # what it kept past n is written over from the next step
            self.slots.store(self.prompt_cache)
        r.cached, r.slot = n, slot
        self.prefilled += len(r.tokens) - n
        self.slots.take(slot, r, n)
        if r.logits_processors:
            r.seen = mx.array(r.tokens)

    def _join(self, f):
        """A prefilled request waits for a slot; its last prompt token runs in its first step."""
        self.filling.remove(f)
        r = f.request
        kv = [(c.keys[..., :c.offset, :], c.values[..., :c.offset, :]) for c in self._caches(f)
              if c.keys is not None]
        if self.prompt_cache is not None and r.cached < len(r.tokens) - 1:
            self.prompt_cache.store(r.tokens[:-1], kv)
        # its twins' rows copies of its one (_place inserts them together)
        self.joining += [Joining(t, kv, len(r.tokens) - 1, r.tokens[-1:]) for t in [r] + r.twins]
        self.prefilled += 1  # the last prompt token, computed in the decode step (each row's)

    def _renumber(self, slots):
        """Take slots (the batch's rows in new places) as the batch's."""
        self.slots = slots
        for i, r in slots.live():
            r.slot = i

    def _layout(self):
        if self.layout is None:
            self.layout = kv_layout(self.model)
        return self.layout

    def _place(self):
        """Give the joining requests slots: a new or resized Slots where the bucket changes."""
        running = self.rows
        rows = running + [j.request for j in self.joining]
        if not rows:
            return
        # room for those under prefill too: they join within a few steps
        coming = rows + [r for f in self.filling for r in [f.request] + f.request.twins]
        size, capacity = bucket(len(coming)), needed_capacity(self.model, coming)
        s = self.slots
        small = s is not None and size < s.size and (size == 1 and forms.compiled_decode()
                                                     or 4 * size <= s.size)
        self.small = self.small + 1 if small else 0
        if s is None or not running and (size > s.size or capacity > s.capacity):
            if s is not None:
                s.store(self.prompt_cache)
            self.slots = Slots(self.model, self._layout(), size, capacity)
        elif self.idle and small and size == 1:
            # a lone newcomer to an idle engine runs solo at once; the slots wait aside for the
            # next wave, with what they kept
            self._renumber(s.resized(size, capacity))
            self._set_aside(s)
        elif size > s.size or capacity > s.capacity or self.small > SHRINK_AFTER:
            s.store(self.prompt_cache)  # (free slots' contents are not carried)
            self._renumber(s.resized(size, capacity))
            if size < s.size and self.spare is None:
                # (a wave prefilled into few slots grown again took a far longer first step than one
                # whose slots waited aside: bench/RESULTS.md, "Serving")
                self._set_aside(s, ran=True)
        # the slots insert takes
        if set(self.slots.free()[:len(self.joining)]) & set(self.slots.unstored):
            self.slots.store(self.prompt_cache)
        # those prefilled together (one kv, whole: they joined in this step), inserted together
        groups = {}
        for j in self.joining:
            groups.setdefault(id(j.kv), []).append(j)
        for group in groups.values():
            slots = self.slots.insert([j.request for j in group], group[0].kv,
                                      [j.feed for j in group], [j.length for j in group])
            for j, slot in zip(group, slots):
                j.request.slot = slot
                if j.request.logits_processors:
                    j.request.seen = mx.array(j.request.tokens)
        self.joining = []

    def _set_aside(self, s, ran=False):
        """Keep slots s, which the batch left, for the next wave (spare: Slots.vacate) where they
        fit kv_budget beside the batch's; else what they kept goes to the prompt cache."""
        if self.kv_budget is not None and s.nbytes + self.slots.nbytes > self.kv_budget:
            s.store(self.prompt_cache)
            return
        self.spare = s
        s.vacate(ran)

    def _read(self, step):
        """Events of a queued step's rows still in the batch (waiting for its tokens), and of the
        rows under a grammar drawn since the last read (runner.Draws)."""
        events, leaving, ruled = [], [], []
        reads = [(step.rows, step.tokens, step.logprobs, False)]
        reads += [(rows, drawn, logprobs, True) for rows, drawn, logprobs in self.draws.taken()]
        mx.eval([tokens for _, tokens, _, _ in reads])
        now = time.perf_counter()
        for rows, tokens, logprobs, drawn in reads:
            tokens = tokens.tolist()
            for k, (i, r) in enumerate(rows):  # i: its slot when the step was queued
                if r.slot is None:  # it left after this step was queued
                    continue
                r.next = t = tokens[k if drawn else i]
                r.generated.append(t)
                made = len(r.generated)
                finish = "stop" if t in r.stop_tokens else ("length" if made >= r.max_tokens
                                                            else None)
                if made == 1:
                    self._started(r, now)
                if r.constraint is not None and not finish:
                    r.constraint.accept(t)
                    ruled.append(r)
                events.append(Event(r, t, logprobs, k if drawn else i, finish))
                if finish:
                    leaving.append(r)
        self.steps += 1
        self.rows_stepped += len(events)
        # (an end-of-sequence token is no token of the answer: usage does not count it)
        self.generated += len(events) - sum(r.generated[-1] in r.stop_tokens for r in leaving)
        self.generation_seconds += sum(now - r.first for r in leaving)
        self._release(leaving)
        self.draws.read(ruled)  # (their next masks)
        return events

    def _started(self, r, now):
        """Count a request's prefill (its choices' first: its twins share it) at its first token."""
        r.first = now
        if r.began is not None:
            self.prompt_seconds += now - r.began
            self.cached_tokens += r.cached

    def _release(self, rows):
        """Take rows out of the batch. Each one's slot keeps what it read, for a newcomer to reuse;
        the prompt cache stores it later (Slots.store), when the slot is taken or dropped or the
        engine idles: a store is a gather a layer, host work a step which the rows finishing one or
        two a step at a batch's end each paid (bench/RESULTS.md, "Serving")."""
        # the last token sampled was never fed; a row that left while fed: what it read
        for r in rows:
            read = ((r.tokens + r.generated)[:-1][:self.slots.pos[r.slot]]
                    if self.prompt_cache is not None else ())
            self.slots.release(r.slot, read)
            if read:
                self.slots.unstored[r.slot] = read
            r.slot = None
            self.draws.forget(r)
