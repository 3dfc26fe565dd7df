"""The one-request worker: SerialWorker generates the server's requests one at a time on the
compiled one-request path (requests.py's worker interface).

Under `mlx.launch -n N` (a tensor-parallel model, shard.py) rank 0 serves with a SerialWorker, which
hands each request to the other ranks (lockstep.broadcast); each of them runs follow(), generating
the same requests step for step (lockstep.lockstep), until rank 0's worker closes."""
import queue
import threading
from contextlib import closing

import mlx.core as mx

from ..decoding import context_length, stream_generate, warmup
from ..loader import materialize
from ..lockstep import lockstep
from ..shard import world
from .requests import Generation, Ticket, token_of


def serve_on_thread(model, serve, warm_up=None):
    """Run serve() on a new daemon thread, after warm_up() there (None: no warm-up); return once the
    warm-up is done, raising its exception here. The model's arrays are evaluated first, on this
    thread (lazy arrays evaluate on the thread that made them); MLX streams belong to their thread,
    so the model then runs on the new one's."""
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

    threading.Thread(target=warm_then_serve, daemon=True).start()
    if (error := started.get()) is not None:
        raise error


class SerialWorker:
    """One thread runs the model, one request at a time, taking them from a queue in order, so
    requests never share a cache or interleave their steps. MLX streams belong to their thread, so
    the model runs on this one's (its arrays are evaluated first, on the caller's thread)."""
    slots = 1

    def __init__(self, model, tokenizer, warm=False):
        """warm: play decoding.warmup on the worker thread first (MLX keeps compiled functions per
        thread, so a warm-up on another thread would not serve it); its exception is raised here."""
        self.model, self.tokenizer = model, tokenizer
        self.context_length, self.vocab_size = context_length(model), model.args.vocab_size
        self.queue = queue.Queue()
        self.closed = threading.Event()
        serve_on_thread(model, self._serve, (lambda: warmup(model)) if warm else None)

    def submit(self, generation):
        ticket = Ticket(generation)
        self.queue.put(ticket)
        return ticket

    def close(self, timeout=30):
        """Stop the worker after the request it generates; under mlx.launch the other ranks'
        follow() ends too (waited for up to timeout seconds)."""
        self.queue.put(None)
        if world() is not None:
            self.closed.wait(timeout)

    def stream(self, g):
        """Yield g's Tokens: the request's whole generation, on the worker thread."""
        return stream_tokens(self.model, self.tokenizer, g)

    def _serve(self):
        while True:
            ticket = self.queue.get()
            if ticket is None:
                Generation.shared(None)
                return self.closed.set()
            if ticket.cancelled:
                continue
            try:
                with closing(self.stream(Generation.shared(ticket.generation))) as stream:
                    for token in stream:
                        if ticket.cancelled:
                            break
                        ticket.put(token)
                ticket.put(None)
            except Exception as e:  # handed to the request's thread, which answers with an error
                ticket.put(e)
            # the step queued ahead: work left pending on a thread's streams aborts at exit
            mx.synchronize()


def stream_tokens(model, tokenizer, g):
    """Yield Generation g's Tokens (under mlx.launch in lockstep with the other ranks: a consumer
    that stops stops them all)."""
    with closing(lockstep(stream_generate(model, tokenizer, g.tokens, g.max_tokens, temp=g.temp,
                                          top_p=g.top_p, top_k=g.top_k, min_p=g.min_p, seed=g.seed,
                                          logits_processors=g.logits_processors(),
                                          grammar=g.grammar))) as responses:
        for r in responses:
            yield token_of(r, g.top_logprobs)


def follow(model, tokenizer, warm=False):
    """A follower rank of a server under mlx.launch: rank 0's warm-up (warm) and then each request
    its SerialWorker hands on, generated in lockstep with it, until that worker closes."""
    if warm:
        warmup(model)
    while (g := Generation.shared()) is not None:
        try:
            for _ in stream_tokens(model, tokenizer, g):
                pass
        except Exception:  # rank 0 failed alike and answered its client with the error: go on
            pass
