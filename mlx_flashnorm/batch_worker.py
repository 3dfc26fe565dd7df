"""The server's batching worker: a batch.BatchEngine stepped on a thread of its own, fed the
server's tickets (worker.py's interface), a burst that finds it idle gathered so that it prefills
together."""
import queue
import time

from .batch import BatchEngine, Request
from .prompt_cache import PromptCache
from .worker import Ticket, serve_on_thread, token_of


class BatchWorker:
    """The server's generation worker (worker.py's interface: slots, submit(Generation) -> Ticket)
    over a BatchEngine on its own thread: MLX streams belong to the thread that made them, so the
    model runs on this one's. A cancelled ticket's request leaves the batch at the next step.

    warm: play BatchEngine.warmup on the thread first; its exception is raised here.
    prompt_cache_bytes: the prompt cache's bound (0: none).
    gather: (gap, most) in seconds: a request that finds the engine idle waits until no other came
    for `gap`, at most `most` in all, so that a burst's requests prefill in one call rather than the
    first alone and the rest behind it (bench/RESULTS.md, "Serving")."""

    def __init__(self, model, tokenizer, warm=False, max_batch=32, prompt_cache_bytes=0, prefill_step=2048,
                 gather=(0.002, 0.02)):
        self.slots, self.gather = max_batch, gather
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

    def flush(self):
        """After each round of put(): nothing here (a worker that sends its tokens on sends them)."""

    def _serve(self):
        while True:
            self._admit(block=not self.engine.busy)
            for r in self.engine.requests():
                r.cancelled = r.cancelled or r.ticket.cancelled
            try:
                events = self.engine.step()
            except Exception as e:  # a failed step fails every request in flight, not the thread
                for r in self.engine.requests():
                    self.put(r.ticket, e)
                self.engine.clear()
                events = []
            for e in events:
                self.put(e.request.ticket, token_of(e, e.request.ticket.generation.top_logprobs))
                if e.finish_reason:
                    self.put(e.request.ticket, None)
            self.flush()

    def _admit(self, block):
        """Move submitted tickets into the engine (if block, waiting for one, then its burst: gather)."""
        try:
            ticket = self.inbox.get(block=block)
            gap, most = self.gather if block else (0, 0)
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
