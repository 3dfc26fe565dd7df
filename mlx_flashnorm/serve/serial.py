"""The one-request worker: SerialWorker generates the server's requests one at a time on the
compiled one-request path (requests.py's worker interface); a request of n choices as n requests,
one after another (its prompt prefilled for each). (Under `mlx.launch` every rank runs the batch
engine instead: lockstep_worker.py.)"""
import queue
import threading
import time
from contextlib import closing
from dataclasses import replace

import mlx.core as mx

from ..decoding import cache_capacity, context_length, stream_generate, warmup
from ..loader import materialize
from .requests import Load, Ticket, token_of


def serve_on_thread(model, serve, warm_up=None):
    """Run serve() on a new daemon thread, after warm_up() there (None: no warm-up), the thread then
    idle until the process exits; return once the warm-up is done, raising its exception here.
    The model's arrays are evaluated first, on this thread (lazy arrays evaluate on the thread that
    made them); MLX streams belong to their thread, so the model then runs on the new one's."""
    materialize(model)
    started = queue.Queue()

    def warm_then_serve():
        try:
            if warm_up is not None:
                warm_up()
        except Exception as e:
            return started.put(e)
        started.put(None)
        serve()
        # this thread never ends: as it would, MLX frees the functions it compiled (kept per
        # thread), which takes the interpreter's lock, and where the interpreter is exiting by then
        # (the server closes its worker last) that aborts the process
        threading.Event().wait()

    threading.Thread(target=warm_then_serve, daemon=True).start()
    if (error := started.get()) is not None:
        raise error


MAX_CHOICES = 16  # choices (n) a request may ask of the server, at most


class SerialWorker:
    """One thread runs the model, one request at a time, taking them from a queue in order, so
    requests never share a cache or interleave their steps. MLX streams belong to their thread, so
    the model runs on this one's (its arrays are evaluated first, on the caller's thread). A
    request's choices run one after another, each with its seed (Generation.seeds)."""
    slots, choices = 1, MAX_CHOICES

    def __init__(self, model, tokenizer, warm=False):
        """warm: play decoding.warmup on the worker thread first (MLX keeps compiled functions per
        thread, so a warm-up on another thread would not serve it); its exception is raised here."""
        self.model, self.tokenizer = model, tokenizer
        self.context_length, self.vocab_size = context_length(model), model.args.vocab_size
        self.queue = queue.Queue()
        self.counted = Load()  # the counters (the worker thread's)
        self.current = None  # (tokens held, cache capacity) of the choice generating
        serve_on_thread(model, self._serve, (lambda: warmup(model)) if warm else None)

    def submit(self, generation):
        ticket = Ticket(generation)
        self.queue.put(ticket)
        return ticket

    def close(self):
        """Stop the worker after the request it generates."""
        self.queue.put(None)

    @property
    def load(self):
        """requests.Load: the counters, one row while a choice generates, the requests queued."""
        held, capacity = self.current or (0, 0)
        return replace(self.counted, rows=int(held > 0), processing=int(held > 0),
                       waiting=self.queue.qsize(), kv_tokens=held, kv_capacity=capacity)

    def stream(self, g):
        """Yield g's Tokens: the request's whole generation, on the worker thread."""
        return stream_tokens(self.model, self.tokenizer, g)

    def _serve(self):
        while True:
            ticket = self.queue.get()
            if ticket is None:
                return
            if ticket.cancelled:
                continue
            try:
                g = ticket.generation
                for choice, seed in enumerate(g.seeds()):
                    if ticket.cancelled:
                        break
                    if choice not in ticket.dropped:
                        self.generate(ticket, replace(g, seed=seed, n=1), choice)
                ticket.put(None)
            except Exception as e:  # handed to the request's thread, which answers with an error
                ticket.put(e)
            finally:
                self.current = None
            # the step queued ahead: work left pending on a thread's streams aborts at exit
            mx.synchronize()

    def generate(self, ticket, g, choice):
        """Put one choice's Tokens (choice: its index) on the ticket, counted."""
        c, start = self.counted, time.perf_counter()
        first, made = None, 0
        capacity = cache_capacity(self.model, len(g.tokens) + g.max_tokens)
        with closing(self.stream(g)) as stream:
            for token in stream:
                if first is None:
                    first = time.perf_counter()
                    c.prompt_tokens += len(g.tokens)
                    c.prompt_seconds += first - start
                    c.calls += 1
                made += 1
                c.generated += token.finish_reason != "stop"
                c.calls, c.steps, c.rows_stepped = c.calls + 1, c.steps + 1, c.rows_stepped + 1
                self.current = (len(g.tokens) + made, capacity)
                if ticket.cancelled or choice in ticket.dropped:
                    break
                token.choice = choice
                ticket.put(token)
        if first is not None:
            c.generation_seconds += time.perf_counter() - first


def stream_tokens(model, tokenizer, g):
    """Yield Generation g's Tokens."""
    with closing(stream_generate(model, tokenizer, g.tokens, g.max_tokens, temp=g.temp,
                                 top_p=g.top_p, top_k=g.top_k, min_p=g.min_p, seed=g.seed,
                                 logits_processors=g.logits_processors(),
                                 grammar=g.grammar)) as responses:
        for r in responses:
            yield token_of(r, g.top_logprobs)
