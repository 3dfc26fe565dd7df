"""What crosses the engine's edges: a checked request (Generation), the tokens that come back
(Token) and the Ticket that carries them, the same for every worker (serial.SerialWorker,
batch_worker.BatchWorker, engine_process.EngineProcess).

A worker has three parts: `slots` (how many requests it generates at once), `submit(generation) ->
Ticket`, and tokens put on the ticket as they come; a batching worker also `kv_tokens`, the
positions its KV budget holds. The HTTP side counts requests against them for its queue limit,
cancels the ticket of a client that hangs up, and turns tokens into text, stop strings and
log-probabilities itself. A worker may also have `choices` (the most choices, `n`, a request may
ask of it; without it, one) and `load` (a Load: what it has done and holds now, for /metrics and
/health; without it, None)."""
import queue
import random
import threading
from dataclasses import dataclass, field, replace
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors

from ..constraints import Constraint
from ..decoding import MAX_SEED


@dataclass
class Generation:
    """A request as the worker needs it, every field already checked (the server answers 400
    first)."""
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
    # None: no log-probabilities; k: the chosen token's and k likeliest
    top_logprobs: Optional[int] = None
    # an llguidance grammar the tokens follow (constraints.py: a JSON schema, a tool call), checked
    grammar: Optional[str] = None
    n: int = 1  # choices: continuations of the prompt, each its own draw (Token.choice)
    # other requests were reaching the server as it took this one: an idle batch worker gathers a
    # burst (BatchWorker's gather) only then, so that a lone request waits for none
    followed: bool = False

    def seeds(self):
        """Each choice's seed: the request's for the first (so that it is n = 1's answer), for each
        other one derived from it, the same on every run; None for each without a seed."""
        if self.seed is None:
            return [None] * self.n
        return [self.seed] + [random.Random(f"{self.seed}/{i}").randrange(MAX_SEED + 1)
                              for i in range(1, self.n)]

    def logits_processors(self):
        """mlx-lm's processors for the penalties and logit bias (each penalty over the last 20
        tokens, its default)."""
        return make_logits_processors(self.logit_bias, self.repetition_penalty,
                                      presence_penalty=self.presence_penalty,
                                      frequency_penalty=self.frequency_penalty)

    def constraint(self, tokenizer, vocab):
        """The constraints.Constraint of its grammar (None without one)."""
        return None if self.grammar is None else Constraint(self.grammar, tokenizer, vocab)


@dataclass
class Token:
    id: int
    finish_reason: Optional[str] = None  # "stop" (an end-of-sequence token), "length", or None
    logprob: Optional[float] = None  # when the Generation asked for log-probabilities
    top_logprobs: list = field(default_factory=list)  # [(id, logprob)], likeliest first
    # on a request's first token: its prompt tokens that came from the prompt cache (not computed)
    cached: int = 0
    choice: int = 0  # the choice it continues (below the Generation's n)


class Ticket:
    """A submitted Generation: the worker puts each Token, then None (done) or the exception that
    stopped it; cancel() makes the worker drop the request at its next step."""

    def __init__(self, generation):
        self.generation = generation
        self._out = queue.Queue()
        self._cancelled = threading.Event()
        self.listener = None  # called with the ticket after each put (streaming.Streamer's notify)
        # called after cancel() or drop() (a batch worker's note to look for cancelled requests)
        self.on_cancel = None
        self.dropped = set()  # choices the client has all of (cut at a stop string): not generated
        self.running = generation.n  # (the worker's) choices not finished yet

    def cancel(self):
        self._cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel()

    def drop(self, choice):
        """Stop generating one choice (the others go on)."""
        self.dropped.add(choice)
        if self.on_cancel is not None:
            self.on_cancel()

    def finished(self):
        """(the worker's) A choice has finished: whether it was the last."""
        self.running -= 1
        return self.running == 0

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


@dataclass
class Load:
    """What a worker has done since it started (counters) and holds at its last look (the others),
    for /metrics and /health. Times are summed over requests, as llama-server sums its slots'."""
    prompt_tokens: int = 0  # prompt tokens computed (not those from the prompt cache)
    cached_tokens: int = 0  # prompt tokens the prompt cache gave
    prompt_seconds: float = 0.0  # each request's, from its prefill's start to its first token
    generated: int = 0  # tokens generated (an end-of-sequence token not counted, as in usage)
    generation_seconds: float = 0.0  # each choice's, from its first token to its last
    calls: int = 0  # model calls: prefill calls and decode steps
    steps: int = 0  # decode steps read
    rows_stepped: int = 0  # rows summed over those steps
    rows: int = 0  # rows in the batch
    processing: int = 0  # rows in the batch or under prefill
    waiting: int = 0  # rows waiting for room in the batch
    kv_tokens: int = 0  # positions the rows hold in the batch's KV cache
    kv_capacity: int = 0  # positions the KV budget holds (without one: the batch's cache now)
    mask_seconds: float = 0.0  # host time of constrained rows' masks (BatchEngine._settle)

    COUNTERS = ("prompt_tokens", "cached_tokens", "prompt_seconds", "generated",
                "generation_seconds", "calls", "steps", "rows_stepped", "mask_seconds")

    def after(self, earlier):
        """This load, its counters added to earlier's (an engine process that was replaced)."""
        return replace(self, **{k: getattr(self, k) + getattr(earlier, k) for k in self.COUNTERS})

    def counted(self):
        """Its counters alone (its state zero: an engine gone)."""
        return Load(**{k: getattr(self, k) for k in self.COUNTERS})


def token_of(r, top_logprobs):
    """The Token of a decoding.Response: with top_logprobs (not None) the chosen token's
    log-probability and the top_logprobs likeliest, read on the host (numpy: no MLX op queued
    behind the next step)."""
    if top_logprobs is None:
        return Token(r.token, r.finish_reason)
    lp = (r.logprobs if r.logprobs.dtype in (mx.float32, mx.float16)
          else r.logprobs.astype(mx.float32))
    lp = np.asarray(lp)
    top = np.argpartition(-lp, top_logprobs)[:top_logprobs] if top_logprobs else np.array([], int)
    top = top[np.argsort(-lp[top], kind="stable")]
    return Token(r.token, r.finish_reason, float(lp[r.token]),
                 [(int(i), float(lp[i])) for i in top])
