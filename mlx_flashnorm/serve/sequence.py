"""One request in the batch (Request: its prompt, sampling, stop tokens and state as it moves
through the engine) and what each step hands back for it (Event)."""
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..decoding import make_sampler_for
from .requests import Ticket


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
    # a grammar its tokens follow (constraints.Constraint: mask, accept), sampled a step late
    # (runner.settle)
    constraint: object = None
    generated: List[int] = field(default_factory=list)
    cached: int = 0  # prompt tokens taken from the prompt cache
    # set by the caller (a stop string, a client gone): it leaves at the next step
    cancelled: bool = False
    next: Optional[int] = None  # the last token read
    ticket: Optional[Ticket] = None  # BatchWorker: where its tokens go
    slot: Optional[int] = None  # its slot of the batch's cache while it decodes
    queued: int = 0  # decode steps queued for it
    seen: Optional[mx.array] = None  # its tokens so far, on the device (for its logits processors)
    # the request's other choices (Generation.n), each a Request of its own: they take its
    # prompt's cache once it is prefilled (BatchEngine._join), and a row each
    twins: list = field(default_factory=list)
    choice: int = 0  # which of its request's choices it is
    # (the engine's counters) when its prefill began (None: a twin) and its first token came
    began: Optional[float] = None
    first: Optional[float] = None

    def __post_init__(self):
        self.sampler = make_sampler_for(self.temp, self.top_p, self.top_k, self.min_p)
        self.key = None if self.seed is None else mx.random.key(self.seed)

    greedy = property(lambda self: self.temp == 0)

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
    table: mx.array  # (slots, vocab): the step's log-probabilities (after the processors)
    row: int  # the request's row of them
    finish_reason: Optional[str]

    @property
    def logprobs(self):
        """(vocab,) the log-probabilities the token was drawn from: sliced when asked (a slice for
        every row of every step cost host time: bench/RESULTS.md, "Host work of the batched
        step")."""
        return self.table[self.row]
