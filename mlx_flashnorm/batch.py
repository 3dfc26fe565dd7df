"""Continuous batching: many requests decoded together, one model call per step for all of them.

A request joins the running batch at any step and leaves it when it finishes, each with its own
sampling (temperature, top-p, min-p, top-k, seed, logits processors), stop tokens and
max_tokens. A newcomer's prompt is prefilled on its own (one row, mlx-lm's KVCache) in chunks of
at most `prefill_step` tokens per engine step, between the others' decode steps, so a long prompt
delays the running streams by one chunk a step rather than by its whole length. Once only its
last token is left it joins the batch: the batch's cache is one mlx-lm BatchKVCache per layer, its
rows left-padded to a common length, each with its own position (the models' per-row RoPE
offsets) and a mask hiding the padding. A prompt cache (prompt_cache.py) spares a newcomer the
prefix an earlier request already read.

Exactness: every row's result is the one-request computation (a norm's deferred 1/RMS is per
row), up to the summation order of a batched matmul and of attention over the padded length. Our
fused GPU kernels take one row: a batch of more runs the plain composition of MLX operations, and
the decode step runs eagerly (no compiled step: the batch's cache changes shape as rows come and
go).

The engine is synchronous (BatchEngine.step); BatchWorker runs one on its own thread for the
server."""
import queue
from collections import deque
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from . import forms
from .generate import cache_capacity, compiled_decode, context_length, decode_offset, make_sampler_for, position
from .prompt_cache import PromptCache
from .worker import Ticket, serve_on_thread, token_of


@dataclass(eq=False)
class Request:
    """One generation: prompt token ids and how to continue them. The engine fills in the rest."""
    tokens: List[int]
    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop_tokens: frozenset = frozenset()  # ids that end it with finish "stop" (EOS)
    logits_processors: list = field(default_factory=list)  # mlx-lm's: f(tokens, logits) -> logits
    generated: List[int] = field(default_factory=list)
    cached: int = 0  # prompt tokens taken from the prompt cache
    cancelled: bool = False  # set by the caller (a stop string, a client gone): it leaves at the next step
    next: Optional[int] = None  # the token the next decode step feeds
    ticket: Optional[Ticket] = None  # BatchWorker: where its tokens go

    def __post_init__(self):
        self.sampler = make_sampler_for(self.temp, self.top_p, self.top_k, self.min_p)
        self.key = None if self.seed is None else mx.random.key(self.seed)

    @property
    def greedy(self):
        return self.temp == 0

    def sample(self, logprobs):
        """The sampler on this row's (1, vocab) log-probabilities. A seeded request draws from its
        own key, split once per token as MLX splits its global key: what a lone request seeded
        with mx.random.seed draws (the filters in make_sampler's order: top-p, min-p, top-k)."""
        if self.key is None or self.temp == 0:
            return self.sampler(logprobs)
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0:
            logprobs = apply_min_p(logprobs, self.min_p)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        self.key, key = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1 / self.temp), key=key)


class Event(NamedTuple):
    """A token generated for a request; finish_reason is "stop" (a stop token), "length" or None."""
    request: Request
    token: int
    logprobs: mx.array  # (vocab,) log-probabilities the token was drawn from (after the processors)
    finish_reason: Optional[str]


class Filling(NamedTuple):
    """A request under prefill: its one-row caches and the prompt tokens still to run."""
    request: Request
    cache: list
    todo: List[int]


def one_row_cache(keys, values):
    """An mlx-lm KVCache holding keys and values (1, kv_heads, n, head_dim) of n tokens."""
    c = KVCache()
    c.keys, c.values, c.offset = keys, values, keys.shape[2]
    return c


class Solo:
    """A batch of one row decoded by the compiled one-request step (generate.compiled_decode, over
    static buffers: our fused kernels where they run), as generate_step decodes a lone request;
    made from the row's keys and values and turned back into them when a newcomer joins."""

    def __init__(self, model, request, kv):
        n = kv[0][0].shape[2]
        capacity = cache_capacity(model, n + request.max_tokens - len(request.generated) + 1)
        self.kv = []
        for k, v in kv:
            pad = [(0, 0), (0, 0), (0, capacity - n), (0, 0)]
            self.kv.append((mx.pad(k, pad), mx.pad(v, pad)))
        self.offset = decode_offset(n)
        self.normalized = not request.logits_processors  # the step's log-softmax, or raw logits
        self.decode = compiled_decode(model, logits=not self.normalized)

    def step(self, token):
        """The (1, vocab) log-probabilities (raw logits where the row has processors) after token."""
        out, self.offset, self.kv = self.decode(mx.array([token], mx.uint32), self.offset, self.kv)
        return out

    def pairs(self):
        n = position(self.offset).item()
        return [(k[..., :n, :], v[..., :n, :]) for k, v in self.kv]


class BatchEngine:
    """Prefills newcomers and decodes the running batch, one step() at a time.

    max_batch: requests decoded together at most (more wait their turn). prefill_step: prompt
    tokens prefilled per step at most. prompt_cache: a PromptCache, or None. prefilled counts the
    prompt tokens the model computed (cache hits excluded). A batch of one row runs the compiled
    one-request step (Solo) where generate_step would (forms.compiled_decode), else the eager
    batched step."""

    def __init__(self, model, max_batch=32, prefill_step=256, prompt_cache=None):
        self.model, self.max_batch, self.prefill_step = model, max_batch, prefill_step
        self.prompt_cache = prompt_cache
        self.waiting = deque()
        self.filling = []
        self.rows = []  # requests in the batch, in the cache's row order
        self.cache = None  # one BatchKVCache per layer while rows (and no solo)
        self.solo = None  # a Solo while one row runs alone
        self.prefilled = 0

    def add(self, request):
        """Queue a request; max_tokens is cut to what the model's context leaves."""
        room = context_length(self.model) - len(request.tokens)
        if not request.tokens or room < 1:
            raise ValueError(f"a prompt of {len(request.tokens)} tokens does not fit the model's "
                             f"context of {context_length(self.model)}")
        request.max_tokens = min(request.max_tokens, room)
        self.waiting.append(request)

    def warmup(self, prompt=16, steps=3):
        """Play one throwaway greedy request (a prompt of `prompt` tokens, `steps` tokens), outside
        the prompt cache and the prefill count, so that a first real request finds MLX's kernels
        compiled (generate.warmup's reason). Call it on the thread that will step the engine."""
        kept, self.prompt_cache, counted = self.prompt_cache, None, self.prefilled
        try:
            self.add(Request([i % self.model.args.vocab_size for i in range(prompt)], max_tokens=steps))
            while self.busy:
                self.step()
        finally:
            self.prompt_cache, self.prefilled = kept, counted

    @property
    def busy(self):
        return bool(self.waiting or self.filling or self.rows)

    def requests(self):
        """Every request added and not finished: waiting, under prefill or in the batch."""
        return list(self.waiting) + [f.request for f in self.filling] + self.rows

    def clear(self):
        """Drop every request (after a failed step)."""
        self.waiting, self.filling, self.rows, self.cache, self.solo = deque(), [], [], None, None

    def step(self):
        """Drop cancelled requests, prefill up to prefill_step prompt tokens, then decode one
        token for every row of the batch. Returns that step's Events."""
        self._drop_cancelled()
        self._prefill()
        return self._decode() if self.rows else []

    def _drop_cancelled(self):
        self.waiting = deque(r for r in self.waiting if not r.cancelled)
        self.filling = [f for f in self.filling if not f.request.cancelled]
        gone = [i for i, r in enumerate(self.rows) if r.cancelled]
        if gone:
            self._remove(gone)

    def _prefill(self):
        while self.waiting and len(self.rows) + len(self.filling) < self.max_batch:
            self.filling.append(self._start(self.waiting.popleft()))
        budget = self.prefill_step
        for f in list(self.filling):
            n = min(budget, len(f.todo))
            if n:
                self.model(mx.array(f.todo[:n])[None], cache=f.cache)
                mx.eval([(c.keys, c.values) for c in f.cache])
                del f.todo[:n]
                budget -= n
                self.prefilled += n
            if not f.todo:
                self._join(f)

    def _start(self, request):
        """The request's one-row caches, filled from the prompt cache where it holds a prefix."""
        n, kv = self.prompt_cache.fetch(request.tokens) if self.prompt_cache else (0, None)
        cache = [one_row_cache(k, v) for k, v in kv] if kv else [KVCache() for _ in self.model.layers]
        request.cached = n
        return Filling(request, cache, list(request.tokens[n:-1]))

    def _join(self, f):
        """Move a prefilled request into the batch; its last prompt token runs in the next decode."""
        self.filling.remove(f)
        r = f.request
        if self.prompt_cache is not None and r.cached < len(r.tokens) - 1:
            self.prompt_cache.store(r.tokens[:-1], [(c.keys[..., :c.offset, :], c.values[..., :c.offset, :])
                                                    for c in f.cache])
        rows = [BatchKVCache.merge([c]) for c in f.cache]
        if self.solo is not None:  # back to the batched step
            self.cache = [BatchKVCache.merge([one_row_cache(k, v)]) for k, v in self.solo.pairs()]
            self.solo = None
        if self.cache is None:
            self.cache = rows
        else:
            for c, new in zip(self.cache, rows):
                c.extend(new)
        self.rows.append(r)
        r.next = r.tokens[-1]
        self.prefilled += 1  # the last prompt token, computed in the decode step

    def _decode(self):
        # a lone row goes solo once its cache holds keys (a one-token prompt's first step runs
        # batched: the static buffers take the cache's shape)
        if (len(self.rows) == 1 and self.solo is None and self.cache[0].keys is not None
                and forms.compiled_decode()):
            self.solo = Solo(self.model, self.rows[0], self._kv(0))
            self.cache = None
        if self.solo is not None:
            out = self.solo.step(self.rows[0].next)
            logprobs = out if self.solo.normalized else log_softmax(self._process(out))
        else:
            y = mx.array([[r.next] for r in self.rows], mx.int32)
            logprobs = log_softmax(self._process(self.model(y, cache=self.cache)[:, -1, :]))
        tokens = self._sample(logprobs)
        mx.eval(tokens, logprobs)
        events, done = [], []
        for i, (r, t) in enumerate(zip(self.rows, tokens.tolist())):
            r.generated.append(t)
            r.next = t
            finish = "stop" if t in r.stop_tokens else ("length" if len(r.generated) >= r.max_tokens else None)
            events.append(Event(r, t, logprobs[i], finish))
            if finish:
                done.append(i)
        if done:
            self._remove(done)
        return events

    def _process(self, logits):
        """Each row's logits processors (penalties), given its tokens so far."""
        if not any(r.logits_processors for r in self.rows):
            return logits
        rows = []
        for i, r in enumerate(self.rows):
            row = logits[i:i + 1]
            if r.logits_processors:
                seen = mx.array(r.tokens + r.generated)
                for p in r.logits_processors:
                    row = p(seen, row)
            rows.append(row)
        return mx.concatenate(rows)

    def _sample(self, logprobs):
        """(rows,) tokens: one argmax over the batch for greedy rows, each other row's sampler."""
        greedy = mx.argmax(logprobs, axis=-1)
        if all(r.greedy for r in self.rows):
            return greedy
        return mx.stack([greedy[i] if r.greedy else r.sample(logprobs[i:i + 1]).reshape(())
                         for i, r in enumerate(self.rows)])

    def _kv(self, i):
        """Row i's keys and values per layer, (1, kv_heads, tokens read, head_dim) each."""
        if self.solo is not None:
            return self.solo.pairs()
        return [(c.keys, c.values) for c in (layer.extract(i) for layer in self.cache)]

    def _remove(self, indices):
        """Take rows out of the batch, keeping what they read in the prompt cache."""
        if self.prompt_cache is not None:
            for i in indices:
                r = self.rows[i]
                read = (r.tokens + r.generated)[:-1]  # the last token sampled was never fed
                self.prompt_cache.store(read, self._kv(i))
        keep = [i for i in range(len(self.rows)) if i not in set(indices)]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = self.solo = None
            return
        for c in self.cache:
            c.filter(mx.array(keep))


def log_softmax(logits):
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class BatchWorker:
    """The server's generation worker (worker.py's interface: slots, submit(Generation) -> Ticket)
    over a BatchEngine on its own thread: MLX streams belong to the thread that made them, so the
    model runs on this one's. A cancelled ticket's request leaves the batch at the next step.

    warm: play BatchEngine.warmup on the thread first; its exception is raised here.
    prompt_cache_bytes: the prompt cache's bound (0: none)."""

    def __init__(self, model, tokenizer, warm=False, max_batch=32, prompt_cache_bytes=0, prefill_step=256):
        self.slots = max_batch
        cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes > 0 else None
        self.engine = BatchEngine(model, max_batch, prefill_step, cache)
        self.stop_tokens = frozenset(tokenizer.eos_token_ids)
        self.inbox = queue.Queue()
        serve_on_thread(model, self._serve, self.engine.warmup if warm else None)

    def submit(self, generation):
        ticket = Ticket(generation)
        self.inbox.put(ticket)
        return ticket

    def put(self, ticket, token):
        """Hand a Token to its ticket (on the worker thread)."""
        ticket.put(token)

    def request(self, ticket):
        g = ticket.generation
        return Request(g.tokens, g.max_tokens, g.temp, g.top_p, g.top_k, g.min_p, g.seed, self.stop_tokens,
                       g.logits_processors(), ticket=ticket)

    def _serve(self):
        while True:
            self._admit(block=not self.engine.busy)
            for r in self.engine.requests():
                r.cancelled = r.cancelled or r.ticket.cancelled
            try:
                events = self.engine.step()
            except Exception as e:  # a failed step fails every request in flight, not the thread
                for r in self.engine.requests():
                    r.ticket.put(e)
                self.engine.clear()
                continue
            for e in events:
                self.put(e.request.ticket, token_of(e, e.request.ticket.generation.top_logprobs))
                if e.finish_reason:
                    e.request.ticket.put(None)

    def _admit(self, block):
        """Move submitted tickets into the engine (waiting for one if block)."""
        try:
            ticket = self.inbox.get(block=block)
            while True:
                if not ticket.cancelled:
                    try:
                        self.engine.add(self.request(ticket))
                    except Exception as e:
                        ticket.put(e)
                ticket = self.inbox.get_nowait()
        except queue.Empty:
            pass
