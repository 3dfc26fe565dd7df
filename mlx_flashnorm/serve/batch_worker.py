"""The server's batching worker: an engine.BatchEngine stepped on a thread of its own, fed the
server's tickets (requests.py's interface), a burst that finds it idle gathered so that it prefills
together."""
import os
import queue
import time

import mlx.core as mx

from ..decoding import CAPACITY_STEP, cache_capacity, context_length
from ..errors import UserError
from .engine import FEED_WAIT, BatchEngine
from .prompt_cache import PromptCache
from .requests import Load, Ticket, token_of
from .sequence import Request
from .serial import MAX_CHOICES, serve_on_thread
from .slots import Slots, bucket, kv_layout, most_rows, needed_capacity, token_bytes

KV_BUDGET = 0.25  # the batch's KV cache by default: this fraction of the device's memory
MAX_ROWS = 256  # rows decoded together at most unless max_batch says otherwise
LOAD_EVERY = 0.1  # seconds between the Loads a busy engine's worker takes


class BatchWorker:
    """The server's generation worker (requests.py's interface: slots, submit(Generation) -> Ticket)
    over a BatchEngine on its own thread: MLX streams belong to the thread that made them, so the
    model runs on this one's. A cancelled ticket's request leaves the batch at the next step.

    warm: play warmup(engine) on the thread first; its exception is raised here.
    prompt_cache_bytes: the prompt cache's bound (0: none).
    gather: (gap, most) in seconds: a request that finds the engine idle while others were reaching
    the server with it (Generation.followed) waits until no other came for `gap`, at most `most` in
    all, so that a burst's requests prefill in one call rather than the first alone and the rest
    behind it (bench/RESULTS.md, "Serving"); a lone request waits for none.
    max_batch, kv_budget: the rows and KV memory (kv_limits) from which follow `slots`, the rows
    decoded together, and `kv_tokens`, the positions the budget holds, against which the server
    counts the requests it takes.

    A request of n choices is n Requests, the first holding the others as its twins (one prefill,
    a row each: engine.py). `load`: the engine's requests.Load, taken after a step at most every
    LOAD_EVERY seconds while it is busy and whenever it goes idle (so that its counters are whole
    once the requests are answered), before that step's tokens are handed out."""

    idle_wait = None  # seconds an idle engine waits for a request at most (None: for ever)
    hold = True  # BatchEngine's hold: a row under a grammar sits a step out, not the step waiting

    def __init__(self, model, tokenizer, warm=False, max_batch=None, prompt_cache_bytes=0,
                 prefill_step=2048, gather=(0.002, 0.02), kv_budget=None):
        self.gather = gather
        self.load, self.looked = Load(), 0.0  # the last Load and when it was taken
        self.context_length, self.vocab_size = context_length(model), model.args.vocab_size
        self.tokenizer, self.stop_tokens = tokenizer, frozenset(tokenizer.eos_token_ids)
        self.inbox = queue.Queue()
        self.cancels = False  # a ticket was cancelled since the last look (set from any thread)

        def start():  # (kv_limits reads the cache's layout off a model call: on the thread)
            self.slots, budget, self.kv_tokens = self.limits(model, max_batch, kv_budget)
            # (every choice of a request decodes at once)
            self.choices = min(MAX_CHOICES, self.slots)
            cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes > 0 else None
            self.engine = BatchEngine(model, self.slots, prefill_step, cache, feed_wait=FEED_WAIT,
                                      kv_budget=budget, hold=self.hold)
            if warm:
                warmup(self.engine)

        serve_on_thread(model, self._serve, start)

    def submit(self, generation):
        return self.enqueue(Ticket(generation))

    def enqueue(self, ticket):
        ticket.on_cancel = self.note_cancel
        self.inbox.put(ticket)
        return ticket

    def note_cancel(self):
        self.cancels = True

    def put(self, ticket, token):
        """Hand a Token to its ticket (on the worker thread)."""
        ticket.put(token)

    def deliver(self, events):
        """Each step's Events to their tickets, a request's None after its last choice's last."""
        for e in events:
            ticket = e.request.ticket
            self.put(ticket, event_token(e))
            if e.finish_reason and ticket.finished():
                self.put(ticket, None)

    def request(self, ticket):
        """The ticket's Request: its first choice's, the others its twins."""
        g = ticket.generation
        first, *twins = [Request(g.tokens, g.max_tokens, g.temp, g.top_p, g.top_k, g.min_p, seed,
                                 self.stop_tokens, g.logits_processors(), ticket=ticket,
                                 constraint=g.constraint(self.tokenizer, self.vocab_size),
                                 choice=i)
                         for i, seed in enumerate(g.seeds())]
        first.twins = twins
        return first

    def limits(self, model, max_batch, kv_budget):
        """kv_limits (on the worker thread)."""
        return kv_limits(model, max_batch, kv_budget)

    def look(self):
        """Take the engine's Load where it is due (the class's note); whether it was."""
        now = time.monotonic()
        if self.engine.busy and now - self.looked < LOAD_EVERY:
            return False
        self.load, self.looked = self.engine.load(), now
        return True

    def flush(self, looked):
        """After each round of put(): nothing here (a worker that sends its tokens on sends
        them, and the Load where looked)."""

    def _serve(self):
        while True:
            self._admit(block=not self.engine.busy)
            if self.cancels:  # (a look at every request adds to each step's host work, per row)
                self._cancel()
            events = self._step()
            looked = self.look()
            self.deliver(events)
            self.flush(looked)

    def _cancel(self):
        """Mark the requests whose tickets were cancelled (or their choices dropped), to leave at
        the next step; returns them."""
        self.cancels = False
        gone = [r for r in self.engine.requests()
                if not r.cancelled and (r.ticket.cancelled or r.choice in r.ticket.dropped)]
        for r in gone:
            r.cancelled = True
        return gone

    def _step(self):
        """The engine's step() and its Events; a failed step fails every request in flight, not
        the thread."""
        try:
            return self.engine.step()
        except Exception as e:
            for r in self.engine.requests():
                self.put(r.ticket, e)
            self.engine.clear()
            return []

    def _admit(self, block):
        """Move submitted tickets into the engine (if block, waiting for one, for at most
        idle_wait seconds, then its burst: gather)."""
        try:
            ticket = self.inbox.get(block=block, timeout=self.idle_wait)
            # a burst, where others were reaching the server with the first (Generation.followed)
            gap, most = self.gather if block and ticket.generation.followed else (0, 0)
            end = time.monotonic() + most
            while True:
                if not ticket.cancelled:
                    try:
                        self.engine.add(self.request(ticket))
                    except Exception as e:
                        self.put(ticket, e)
                wait = min(gap, end - time.monotonic())
                ticket = self.inbox.get(timeout=wait) if wait > 0 else self.inbox.get_nowait()
        except queue.Empty:
            pass


def kv_limits(model, max_batch=None, kv_budget=None):
    """(rows, budget bytes, positions) of a batch of model's like llama-server's context size:
    kv_budget, what the batch's KV cache may take, in bytes (an int) or as a fraction of the
    device's memory (a float; None: KV_BUDGET, at least one request at the model's whole context);
    the rows of one cache step's capacity (decoding.CAPACITY_STEP) it holds, at most max_batch
    (None: MAX_ROWS); the positions it holds. A budget given below one request at the model's
    whole context is a UserError."""
    per_token = token_bytes(kv_layout(model))
    whole = cache_capacity(model, context_length(model))
    budget = budget_bytes(KV_BUDGET if kv_budget is None else kv_budget)
    if budget < whole * per_token:
        if kv_budget is not None:
            raise UserError(f"--kv-budget {budget} bytes holds {budget // per_token} positions of "
                            f"this model's KV cache, fewer than one request at its context of "
                            f"{whole}: give at least {whole * per_token}")
        budget = whole * per_token
    rows = most_rows(budget // per_token // cache_capacity(model, CAPACITY_STEP))
    return min(max_batch or MAX_ROWS, rows), budget, budget // per_token


def device_memory():
    """Bytes of the default device's memory as MLX reports it (Metal: memory_size, CUDA:
    total_memory); on the CPU, the machine's."""
    info = mx.device_info()
    size = info.get("memory_size") or info.get("total_memory")
    return int(size) if size else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def budget_bytes(budget):
    """A KV budget in bytes: an int is bytes, a float the fraction of the device's memory."""
    return int(budget * device_memory()) if isinstance(budget, float) else budget


def event_token(e):
    """The Token of Event e (token_of, as its request asked); a request's first carries how many of
    its prompt tokens came from the prompt cache."""
    t = token_of(e, e.request.ticket.generation.top_logprobs)
    t.choice = e.request.choice
    if len(e.request.generated) == 1:
        t.cached = e.request.cached
    return t


def warmup(engine, prompt=16, steps=3):
    """On a BatchEngine, play one throwaway greedy request (a prompt of `prompt` tokens, `steps`
    tokens), then two and four together (their shared prefill calls, from the first one's half of
    their prompts where the engine has a prompt cache: then a throwaway one), then two newcomers
    fed beside running rows into slots apart (their gathers and scatter: MLX compiles a kernel at
    its first use: bench/RESULTS.md, "Serving"), then a lone request whose
    batch grows into the slots set aside (Slots.moved), outside the prompt cache
    and the counters (load), so that a first real request finds MLX's kernels compiled
    (decoding.warmup's reason) and the prompt cache's copies too (a first store is slow:
    bench/RESULTS.md, "Serving"), with no bound on feeding (its steps
    compile) and no step period kept; then trace the batched step of every
    bucket up to max_batch, at the first capacity. Call it on the thread that will step the
    engine."""
    kept, wait = engine.prompt_cache, engine.feed_wait
    counted = {k: getattr(engine, k) for k in engine.COUNTERS}
    engine.feed_wait = None
    engine.prompt_cache = None if kept is None else PromptCache(1 << 26)
    vocab = engine.model.args.vocab_size
    first = [i % vocab for i in range(prompt)]
    try:
        engine.add(Request(first, max_tokens=steps))
        while engine.busy:
            engine.step()
        # shared prefill calls (MLX compiles its quantized matmul for up to 16, 32 and more rows:
        # 15, 30 and 60 here), not reuses of the last slots
        for n in (2, 4):
            engine.slots = None
            for k in range(n):
                tail = [(i + k + n) % vocab for i in range(prompt - prompt // 2)]
                engine.add(Request(first[:prompt // 2] + tail, max_tokens=steps))
            while engine.busy:
                engine.step()
        engine.slots = None
        group = [Request(first[:prompt // 2]
                         + [(i + 9 + k) % vocab for i in range(prompt - prompt // 2)],
                         max_tokens=m) for k, m in enumerate((6 * steps, 1, 6 * steps, 1))]
        for r in group:
            engine.add(r)
        engine.step()
        # rows 1 and 3 have left: newcomers fed beside 0 and 2 take slots 1 and 3 (a scatter)
        engine.step()
        # (not reused from slots 1 and 3:) prefixes from two blocks of the prompt cache
        engine.slots.left, engine.slots.table = [()] * engine.slots.size, None
        engine.add(Request(first + [1], max_tokens=steps))
        engine.add(Request(first[:prompt // 2]
                           + [(i + 4) % vocab for i in range(prompt - prompt // 2)] + [1],
                           max_tokens=steps))
        while engine.busy:
            engine.step()
        # alone at the idle engine: solo, its slots aside; newcomers then grow the batch into them
        # (the solo row's copy, a scatter)
        engine.add(Request(first + [2], max_tokens=steps))
        engine.step()
        for k in range(2):
            engine.add(Request(first + [3 + k], max_tokens=steps))
        while engine.busy:
            engine.step()
        engine.slots = engine.spare = None
        size = 2
        while size <= bucket(engine.max_batch):
            engine._layout()
            slots = Slots(engine.model, engine.layout, size,
                          needed_capacity(engine.model, [Request([0], 1)]))
            mx.eval(slots.decode())
            size *= 2
    finally:
        engine.prompt_cache, engine.feed_wait = kept, wait
        vars(engine).update(counted)
        engine.periods.clear()
