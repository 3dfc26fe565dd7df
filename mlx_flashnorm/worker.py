"""The server's generation worker: it takes checked requests (Generation) and hands back their
tokens (Token) through a Ticket, one request at a time.

This is the one piece of the server that runs the model. Anything with the same three parts can
replace SerialWorker (a batching engine, say): `slots` (how many requests it generates at once),
`submit(generation) -> Ticket`, and tokens put on the ticket as they come. The server counts
requests against slots for its queue limit, cancels the ticket of a client that hangs up, and turns
tokens into text, stop strings and log-probabilities itself.

Under `mlx.launch -n N` (a tensor-parallel model, shard.py) rank 0 serves with a SerialWorker, which
hands each request to the other ranks (lockstep.broadcast); each of them runs follow(), generating
the same requests step for step (lockstep.lockstep), until rank 0's worker closes."""
import queue
import random
import threading
from contextlib import closing
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors

from .generate import stream_generate, warmup
from .loader import materialize
from .lockstep import broadcast, lockstep
from .shard import world


@dataclass
class Generation:
    """A request as the worker needs it, every field already checked (the server answers 400 first)."""
    tokens: list  # the prompt's token ids
    max_tokens: int  # the prompt and these fit in the model's context
    seed: Optional[int] = None
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict] = None  # token id -> added to its logit
    top_logprobs: Optional[int] = None  # None: no log-probabilities; k: the chosen token's and k likeliest

    @classmethod
    def shared(cls, generation=None):
        """Rank 0's generation on every rank (lockstep.broadcast; None once rank 0's worker closes);
        the followers pass nothing. Rank 0 draws a seed for a request without one (each process,
        and each thread, has its own random state); alone, the generation as it is."""
        if world() is None:
            return generation
        if generation is not None and generation.seed is None:
            generation = replace(generation, seed=random.SystemRandom().randrange(2**63))
        d = broadcast(None if generation is None else asdict(generation))
        if d is None:
            return None
        if d["logit_bias"] is not None:  # JSON made its token ids strings
            d["logit_bias"] = {int(k): v for k, v in d["logit_bias"].items()}
        return cls(**d)

    def logits_processors(self):
        """mlx-lm's processors for the penalties and logit bias (each penalty over the last 20 tokens,
        its default)."""
        return make_logits_processors(self.logit_bias, self.repetition_penalty,
                                      presence_penalty=self.presence_penalty,
                                      frequency_penalty=self.frequency_penalty)


@dataclass
class Token:
    id: int
    finish_reason: Optional[str] = None  # "stop" (an end-of-sequence token), "length", or None
    logprob: Optional[float] = None  # when the Generation asked for log-probabilities
    top_logprobs: list = field(default_factory=list)  # [(id, logprob)], likeliest first


class Ticket:
    """A submitted Generation: the worker puts each Token, then None (done) or the exception that
    stopped it; cancel() makes the worker drop the request at its next step."""

    def __init__(self, generation):
        self.generation = generation
        self._out = queue.Queue()
        self._cancelled = threading.Event()
        self.listener = None  # called with the ticket after each put (streaming.Streamer's notify)
        self.on_cancel = None  # called after cancel() (a batch worker's note to look for cancelled requests)

    def cancel(self):
        self._cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel()

    @property
    def cancelled(self):
        return self._cancelled.is_set()

    def put(self, item):
        self._out.put(item)
        if self.listener is not None:
            self.listener(self)

    def next(self, timeout=None):
        """The next Token, None once finished; queue.Empty after timeout seconds without one."""
        item = self._out.get(timeout=timeout)
        if isinstance(item, Exception):
            raise item
        return item

    def take(self):
        """Every item waiting, without waiting ([] for none)."""
        items = []
        while not self._out.empty():
            items.append(self._out.get())
        return items


def token_of(r, top_logprobs):
    """The Token of a generate.Response: with top_logprobs (not None) the chosen token's log-probability
    and the top_logprobs likeliest, read on the host (numpy: no MLX op queued behind the next step)."""
    if top_logprobs is None:
        return Token(r.token, r.finish_reason)
    lp = r.logprobs if r.logprobs.dtype in (mx.float32, mx.float16) else r.logprobs.astype(mx.float32)
    lp = np.asarray(lp)
    top = np.argpartition(-lp, top_logprobs)[:top_logprobs] if top_logprobs else np.array([], int)
    top = top[np.argsort(-lp[top], kind="stable")]
    return Token(r.token, r.finish_reason, float(lp[r.token]), [(int(i), float(lp[i])) for i in top])


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
        """warm: play generate.warmup on the worker thread first (MLX keeps compiled functions per
        thread, so a warm-up on another thread would not serve it); its exception is raised here."""
        self.model, self.tokenizer = model, tokenizer
        self.queue = queue.Queue()
        self.closed = threading.Event()
        serve_on_thread(model, self._serve, (lambda: warmup(model)) if warm else None)

    def submit(self, generation):
        ticket = Ticket(generation)
        self.queue.put(ticket)
        return ticket

    def close(self, timeout=30):
        """Stop the worker after the request it generates; under mlx.launch the other ranks' follow()
        ends too (waited for up to timeout seconds)."""
        self.queue.put(None)
        if world() is not None:
            self.closed.wait(timeout)

    def tokens(self, g):
        """Yield g's Tokens: the request's whole generation, on the worker thread."""
        return tokens(self.model, self.tokenizer, g)

    def _serve(self):
        while True:
            ticket = self.queue.get()
            if ticket is None:
                Generation.shared(None)
                return self.closed.set()
            if ticket.cancelled:
                continue
            try:
                with closing(self.tokens(Generation.shared(ticket.generation))) as tokens:
                    for token in tokens:
                        if ticket.cancelled:
                            break
                        ticket.put(token)
                ticket.put(None)
            except Exception as e:  # handed to the request's thread, which answers with an error
                ticket.put(e)
            mx.synchronize()  # the step queued ahead: work left pending on a thread's streams aborts at exit


def tokens(model, tokenizer, g):
    """Yield Generation g's Tokens (under mlx.launch in lockstep with the other ranks: a consumer
    that stops stops them all)."""
    with closing(lockstep(stream_generate(model, tokenizer, g.tokens, g.max_tokens, temp=g.temp, top_p=g.top_p,
                                          top_k=g.top_k, min_p=g.min_p, seed=g.seed,
                                          logits_processors=g.logits_processors()))) as responses:
        for r in responses:
            yield token_of(r, g.top_logprobs)


def follow(model, tokenizer, warm=False):
    """A follower rank of a server under mlx.launch: rank 0's warm-up (warm) and then each request
    its SerialWorker hands on, generated in lockstep with it, until that worker closes."""
    if warm:
        warmup(model)
    while (g := Generation.shared()) is not None:
        try:
            for _ in tokens(model, tokenizer, g):
                pass
        except Exception:  # rank 0 failed alike and answered its client with the error: go on
            pass
