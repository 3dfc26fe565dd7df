"""The batch's static KV cache and its compiled decode step (engine.py decodes with them).

Every row of the batch owns a slot: row `i` of one preallocated buffer per layer, of shape
(slots, kv_heads, capacity, head_dim), holding its keys and values from position 0 on, so rows of
different lengths share the buffers without padding. Each row has its own position (an int32
array of one entry per slot): RoPE takes it per row, the step writes the new key and value at it
(one scatter), and the attention's mask covers positions 0..position of that row (and, on a
sliding-window layer, only the last window of them). A free slot is idle: its position stays where
it is (the step adds `inc`, 0 for it), its token and result are thrown away, and its mask still
covers one position, so its softmax has something to normalize (no NaN; rows never mix anyway).

The shapes are fixed per (slots, capacity) bucket: slots in BUCKETS, capacity in multiples of
decoding.CAPACITY_STEP (decoding.cache_capacity). mx.compile traces the step once per bucket; a
row joining or leaving inside the bucket only changes arrays (positions, inc, tokens), never the
graph.
A bucket of one slot decodes with the one-request compiled step (decoding.compiled_decode: our
fused one-row kernels where they run), where generate_step would use it."""
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .. import forms
from ..decoding import CompiledStep, cache_capacity, compiled_decode, decode_offset
from .prompt_cache import shared_prefixes, token_rows

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # slots a batch is padded to; beyond, multiples of the last


def bucket(n):
    """The number of slots for n rows."""
    for b in BUCKETS:
        if n <= b:
            return b
    return -(-n // BUCKETS[-1]) * BUCKETS[-1]


def most_rows(n):
    """The most rows whose bucket has at most n slots (0 below one slot)."""
    if n >= BUCKETS[-1]:
        return n // BUCKETS[-1] * BUCKETS[-1]
    return max((b for b in BUCKETS if b <= n), default=0)


def token_bytes(layout):
    """Bytes a position of a row takes in the batch's cache (kv_layout): every layer's key and
    value."""
    return sum(2 * h * d * t.size for h, d, t in layout)


class RowsKVCache:
    """One layer's cache inside the batched step: keys and values (slots, heads, capacity, dim),
    offset (slots,) the position each row's new token takes."""

    static_rows = True  # flashnorm.decode_stack may run every layer of the step in one kernel

    def __init__(self, keys, values, offset):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys, values):
        at = mx.broadcast_to(self.offset.reshape(-1, 1, 1, 1), keys.shape)  # one token per row
        self.keys = mx.put_along_axis(self.keys, at, keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(at, values.shape), values,
                                        axis=2)
        return self.keys, self.values

    def make_mask(self, N, return_array=False, window_size=None):
        """(slots, 1, 1, capacity) booleans: the positions each row's token attends to."""
        j = mx.arange(self.keys.shape[2])[None]
        pos = self.offset[:, None]
        valid = j <= pos
        if window_size is not None:
            valid = valid & (j > pos - window_size)
        return valid[:, None, None, :]

    @property
    def state(self):
        return self.keys, self.values


def batched_decode(model, logits=False):
    """The batch's 1-token step as one compiled function of (tokens (slots,) uint32, positions
    (slots,) int32, inc (slots,) int32, kv buffers), kept on the model as compiled_decode keeps
    its own. Returns (log-probabilities (slots, vocab), their argmax, positions + inc, kv);
    logits: the raw logits instead of log-probabilities (for logits processors)."""
    name = "_batched_logits" if logits else "_batched_decode"
    kept = getattr(model, name, None)
    if kept is None or not kept.current():
        def step(tokens, offset, inc, kv):
            cache = [RowsKVCache(k, v, offset) for k, v in kv]
            out = model(tokens[:, None], cache=cache)[:, -1, :]
            if not logits:
                out = out - mx.logsumexp(out, axis=-1, keepdims=True)
            return out, mx.argmax(out, axis=-1), offset + inc, [c.state for c in cache]

        setattr(model, name, CompiledStep(model, mx.compile(step)))
    return getattr(model, name).fn


def kv_layout(model):
    """[(kv_heads, head_dim, dtype)] per layer, read off the graph of a one-token forward pass over
    mlx-lm's cache (built, never evaluated)."""
    cache = [KVCache() for _ in model.layers]
    model(mx.zeros((1, 1), mx.uint32), cache=cache)
    return [(c.keys.shape[1], c.keys.shape[3], c.keys.dtype) for c in cache]


class Slots:
    """The batch's buffers and, per slot, its request (None: free), position and next token.

    Host side: rows and pos (positions as ints, for the bookkeeping); device side: kv, offset,
    inc and tokens, rebuilt from the host lists only when rows join or leave (dirty). tokens is
    the last queued step's sampled tokens, so the next step can be queued before they are read;
    a newcomer's slot is fed host tokens instead (feed: its prompt tokens the cache does not hold,
    one a step), and samples nothing while two or more are left (feeding). A free slot keeps what
    its last row read (left: those token ids; an idle slot writes only at its own position, past
    them), so a newcomer sharing a prefix with it takes the slot without a copy (reuse, as
    llama-server's slots keep their prompts)."""

    def __init__(self, model, layout, size, capacity):
        self.model, self.layout, self.size, self.capacity = model, layout, size, capacity
        self.kv = [(mx.zeros((size, h, capacity, d), t), mx.zeros((size, h, capacity, d), t))
                   for h, d, t in layout]
        self.rows = [None] * size
        self.pos = [0] * size
        self.feed = {}  # slot -> host tokens it feeds next, in order (a newcomer's prompt)
        self.left = [()] * size  # free slot -> the token ids its positions 0.. still hold
        # free slot -> its left, where the prompt cache does not hold it yet (store)
        self.unstored = {}
        self.table = None  # left as prompt_cache.token_rows: reuse
        self.tokens = None  # (size,) uint32 device array: the last step's tokens
        self.dirty = True
        self.offset = self.inc = self.held = None

    @property
    def solo(self):
        """Whether this bucket decodes with the one-request compiled step."""
        return self.size == 1 and forms.compiled_decode()

    @property
    def nbytes(self):
        """Bytes its buffers take."""
        return self.size * self.capacity * token_bytes(self.layout)

    def live(self):
        return [(i, r) for i, r in enumerate(self.rows) if r is not None]

    def feeding(self, i):
        """Whether slot i's next step feeds a prompt token with another after it: its output is
        not a token of its request."""
        return len(self.feed.get(i, ())) > 1

    def insert(self, requests, kv, feeds, lengths):
        """Put requests in free slots, a group prefilled together at once (one copy per layer, not
        one per row and layer): requests[j] is row j of kv ([(keys, values)] per layer,
        (len(requests), heads, n, dim); none: nothing cached) up to its lengths[j] positions (those
        after are never read: a row attends up to its position, and writes it), and feeds the
        tokens feeds[j] next, one a step. Returns their slots."""
        free = self.free()[:len(requests)]
        n = kv[0][0].shape[2] if kv else 0
        if n:
            first, run = free[0], free == list(range(free[0], free[0] + len(free)))
            where = slice(first, first + len(free)) if run else mx.array(free)
            for layer, (k, v) in enumerate(kv):
                bk, bv = self.kv[layer]
                bk[where, :, :n, :] = k
                bv[where, :, :n, :] = v
                self.kv[layer] = (bk, bv)
        for i, request, feed, m in zip(free, requests, feeds, lengths):
            self.rows[i], self.pos[i], self.feed[i] = request, m, list(feed)
        self.dirty = True
        return free

    def free(self):
        """The free slots, in the order insert takes them."""
        return [i for i, r in enumerate(self.rows) if r is None]

    def store(self, prompt_cache):
        """Keep in prompt_cache what free slots read and it does not hold yet (unstored), in one
        store."""
        if self.unstored:
            held, self.unstored = self.unstored, {}
            prompt_cache.store_rows(list(held.values()), self.kv, list(held))

    def reuse(self, tokens):
        """(slot, n): the free slot whose kept tokens share the longest prefix with tokens, n of
        them, at most len(tokens) - 1 (the last prompt token always runs); (None, 0) if none
        does."""
        if self.table is None:
            self.table = token_rows(self.left)
        shared = shared_prefixes(self.table, tokens[:-1])
        shared[[i for i, r in enumerate(self.rows) if r is not None]] = 0
        i = int(shared.argmax())
        return (i, int(shared[i])) if shared[i] > 0 else (None, 0)

    def take(self, i, request, n):
        """Put request in free slot i, its first n positions those the slot kept (reuse); it is fed
        the rest of its prompt."""
        self.rows[i], self.pos[i], self.feed[i] = request, n, list(request.tokens[n:])
        self.dirty = True

    def release(self, i, read=()):
        """Free slot i, keeping the token ids its row read (their keys and values stay in it)."""
        self.rows[i] = None
        self.feed.pop(i, None)
        self.left[i], self.table = tuple(read), None
        self.dirty = True

    def resized(self, size, capacity):
        """A new Slots of (size, capacity) holding the live rows, in order, from slot 0."""
        live = [i for i, r in enumerate(self.rows) if r is not None]
        new = Slots.__new__(Slots)
        new.model, new.layout, new.size, new.capacity = self.model, self.layout, size, capacity
        idx = mx.array(live, mx.int32)
        new.kv = [(fit(k[idx], size, capacity), fit(v[idx], size, capacity)) for k, v in self.kv]
        new.rows = [self.rows[i] for i in live] + [None] * (size - len(live))
        new.pos = [self.pos[i] for i in live] + [0] * (size - len(live))
        new.feed = {j: self.feed[i] for j, i in enumerate(live) if i in self.feed}
        # free slots' contents are not carried
        new.left, new.table, new.unstored = [()] * size, None, {}
        new.tokens = (None if self.tokens is None
                      else mx.pad(self.tokens[idx], [(0, size - len(live))]))
        new.dirty, new.offset, new.inc, new.held = True, None, None, None
        return new

    def moved(self, into):
        """into (a Slots of larger size, set aside with rows it had kept) holding this one's live
        rows in its free slots, those that kept least first: one copy per layer."""
        live = [i for i, r in enumerate(self.rows) if r is not None]
        into.dirty = True
        if not live:
            return into
        free = sorted((i for i, r in enumerate(into.rows) if r is None),
                      key=lambda i: len(into.left[i]))[:len(live)]
        src, dst = mx.array(live, mx.int32), mx.array(free, mx.int32)
        for layer, (k, v) in enumerate(self.kv):
            bk, bv = into.kv[layer]
            bk[dst] = fit(k[src], len(live), into.capacity)
            bv[dst] = fit(v[src], len(live), into.capacity)
            into.kv[layer] = (bk, bv)
        for i, j in zip(live, free):
            into.rows[j], into.pos[j], into.left[j] = self.rows[i], self.pos[i], ()
            if i in self.feed:
                into.feed[j] = self.feed[i]
        into.table = None
        if self.tokens is not None:
            tokens = mx.zeros((into.size,), mx.uint32) if into.tokens is None else into.tokens
            tokens[dst] = self.tokens[src]
            into.tokens = tokens
        return into

    def vacate(self, ran=False):
        """Free every slot of a Slots set aside, each keeping what it kept before its row took it;
        ran: its rows ran in it, so their slots keep nothing."""
        if ran:
            self.left, self.table = [() if r is not None else kept
                                     for r, kept in zip(self.rows, self.left)], None
        self.rows, self.feed, self.dirty = [None] * self.size, {}, True

    def inputs(self, held=frozenset()):
        """(tokens, offset, inc) of the next step, rebuilt on the device where rows changed or
        the slots held (sitting the step out) did."""
        if self.tokens is None or self.feed:
            host = mx.array([self.feed[i].pop(0) if i in self.feed else 0
                             for i in range(self.size)], mx.uint32)
            is_new = mx.array([i in self.feed or self.tokens is None for i in range(self.size)])
            self.tokens = host if self.tokens is None else mx.where(is_new, host, self.tokens)
            self.feed = {i: f for i, f in self.feed.items() if f}
        if self.dirty:
            self.offset = decode_offset(self.pos[0]) if self.solo else mx.array(self.pos, mx.int32)
            self.steps = {}  # logits -> the compiled step (decode)
            self.held = None
            self.dirty = False
        if held != self.held:
            self.inc = mx.array([int(r is not None and i not in held)
                                 for i, r in enumerate(self.rows)], mx.int32)
            self.held = held
        return self.tokens, self.offset, self.inc

    def decode(self, logits=False, held=frozenset()):
        """Queue one decode step over every slot: (out (size, vocab), argmax (size,)); the
        positions and buffers advance (lazily), but those of free slots and of the live rows'
        slots `held`, which sit the step out (their outputs thrown away; the one-request step
        holds none). The caller sets self.tokens to the tokens it samples."""
        assert not (held and self.solo), "the one-request step holds no row"
        tokens, offset, inc = self.inputs(held)
        run = self.steps.get(logits)
        # the model's compiled step, checked against the model when rows change, not every step
        if run is None:
            run = self.steps[logits] = (compiled_decode if self.solo
                                        else batched_decode)(self.model, logits)
        if self.solo:
            out, self.offset, self.kv = run(tokens, offset, self.kv)
            greedy = mx.argmax(out, axis=-1)
        else:
            out, greedy, self.offset, self.kv = run(tokens, offset, inc, self.kv)
        for i, r in enumerate(self.rows):
            if r is not None and i not in held:
                self.pos[i] += 1
        return out, greedy


def one_row_cache(keys, values):
    """An mlx-lm KVCache holding keys and values (1, kv_heads, n, head_dim) of n tokens."""
    c = KVCache()
    c.keys, c.values, c.offset = keys, values, keys.shape[2]
    return c


def rows_of(x, rows, width):
    """Rows `rows` (an index array) of x (rows, heads, positions, dim) at their first `width`
    positions (zeros past its own)."""
    x = x[rows, :, :width, :]
    return mx.pad(x, [(0, 0), (0, 0), (0, width - x.shape[2]), (0, 0)]) if x.shape[2] < width else x


def fit(x, size, capacity):
    """x (rows, heads, positions, dim) padded with zeros (or cut) to (size, heads, capacity,
    dim)."""
    if x.shape[2] > capacity:
        x = x[:, :, :capacity, :]
    return mx.pad(x, [(0, size - x.shape[0]), (0, 0), (0, capacity - x.shape[2]), (0, 0)])


def needed_capacity(model, rows):
    """The static capacity for rows (requests): each writes positions up to its prompt + max_tokens
    (one more than it keeps: a step queued before its last token was read)."""
    return cache_capacity(model, max(need(r) for r in rows))


def need(r):
    """The positions request r writes at most: its prompt and max_tokens."""
    return len(r.tokens) + r.max_tokens
