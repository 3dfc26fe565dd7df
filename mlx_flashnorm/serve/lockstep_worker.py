"""The server's batch engine under `mlx.launch -n N` (a tensor-parallel model, shard.py): the same
BatchEngine on every rank, stepped in lockstep.

Rank 0 serves: its LockstepWorker is the server's BatchWorker, and before each engine step it hands
the other ranks the step's plan (lockstep.broadcast): the requests it admitted (their Generations,
each with a sampling seed: rank 0 draws one for a request without; the seeds of its n choices
follow from it, Generation.seeds), the rows that left (a request cancelled: a client gone, a
timeout; or one choice dropped: a stop string), and what the engine's own choices read that is not
the same on every rank (the fastest recent step's period, which decides which newcomers are fed
through the decode steps). The KV budget (--kv-budget; by default a fraction of the device's
memory) is rank 0's, handed on once at the start (limits), so every rank's engine admits the same
waiting requests into the batch. Every other rank's LockstepWorker takes the plan and runs the same
engine step on its shard: the engine's other choices (admission, prefill groups, slots, buckets,
the prompt cache) follow from the same requests in the same order and the same budget, every
sharded linear's sum pairs the ranks' operations one to one, and the logits are the same on every
rank, so each request's seeded sampler draws the same tokens everywhere (the Load of /metrics and
/health is rank 0's engine's); a digest of each step's tokens rides on the next plan's exchange
and every rank raises where they differ (no exchange added). A step with nothing new exchanges
8 bytes a rank. A rank waiting in a sum keeps a core busy (MLX's ring backend polls its sockets),
so an idle engine does not wait for a request there: every rank sleeps IDLE_TICK seconds after
each idle step, and a request that finds the engine idle waits for the next tick.

Clean ends: rank 0's close() sends a last plan that ends every rank's loop. A rank that dies leaves
the others waiting in a sum (or, at times, failing in it): a Watchdog on every rank ends the wait
where a plan's exchange (the ranks meet there within milliseconds) takes `timeout` seconds, or a
step (a long prompt's chunk, a first compile) STEP_TIMEOUTS times that. Either way the worker is
`fatal`: rank 0 fails every request in flight with the reason, and the server exits with it on one
line, as each other rank does with its own (lockstep.abandon: a thread may be left waiting in a
sum)."""
import itertools
import random
import threading
import time
import zlib
from dataclasses import asdict, replace

import numpy as np

from ..errors import UserError
from ..lockstep import Watchdog, broadcast, leads
from .batch_worker import BatchWorker, kv_limits
from .requests import Generation, Ticket

IDLE_TICK = 0.05  # seconds every rank sleeps after an idle step: the wait of a request that
# finds the engine idle, at most, against a core kept polling by each rank waiting in the next sum
RANK_TIMEOUT = 30.0  # seconds a rank waits for the others' plan exchange (the server's default)
STEP_TIMEOUTS = 10  # a step may take this many times as long (a first compile on a CPU took
# tens of seconds: bench/RESULTS.md, "Tensor parallelism")


class LockstepWorker(BatchWorker):
    """A BatchWorker on every rank of mlx.launch (requests.py's worker interface on rank 0; the
    other ranks submit nothing: wait() for their end). timeout: seconds a plan's exchange may take
    (a step STEP_TIMEOUTS times as long) before the other ranks are taken for gone (the server's
    --rank-timeout); the rest as BatchWorker's."""

    # (whether a grammar's mask is done when a step is queued is a thread's timing, not the same on
    # every rank: each step waits for its masks)
    hold = False

    def __init__(self, model, tokenizer, warm=False, max_batch=None, prompt_cache_bytes=0,
                 prefill_step=2048, timeout=RANK_TIMEOUT, kv_budget=None):
        self.timeout = timeout
        self.idle_wait = 0  # (rank 0's _admit takes a burst waiting, never waits for one)
        self.keys, self.added = itertools.count(), []
        self.digest = 0  # of the last step's tokens
        self.closing, self.done = False, threading.Event()
        self.fatal = self.problem = None  # why the ranks stopped; problem: the server's 503 reason
        super().__init__(model, tokenizer, warm, max_batch, prompt_cache_bytes, prefill_step,
                         kv_budget=kv_budget)

    def limits(self, model, max_batch, kv_budget):
        """Rank 0's kv_limits on every rank (the budget's default reads the device's memory, which
        the ranks need not share): every rank's engine admits by the same budget; a budget too
        small is a UserError on every rank."""
        if leads():
            try:
                limits = kv_limits(model, max_batch, kv_budget)
            except UserError as e:
                limits = str(e)
        else:
            limits = None
        limits = broadcast(limits)
        if isinstance(limits, str):
            raise UserError(limits)
        return tuple(limits)

    def close(self):
        """Stop every rank after this step (rank 0): returns once the plan went, the ranks failed,
        or `timeout` seconds passed (a rank stuck in a step: those left are ended by the
        launcher, or by their watchdogs, once rank 0 is gone)."""
        self.closing = True
        if not self.done.wait(self.timeout):
            self._fail(f"the tensor-parallel ranks did not take the close in {self.timeout:g} s "
                       "(--rank-timeout): a rank is gone or stalled")

    def wait(self):
        """(the other ranks) Until rank 0 closes, or the ranks fail: returns fatal."""
        self.done.wait()
        return self.fatal

    def request(self, ticket):
        """(rank 0) The engine's Request for ticket, its generation (with a seed drawn where it has
        none: its n choices' seeds follow from it, Generation.seeds) added to the next plan under a
        new key."""
        g = ticket.generation
        if g.seed is None:
            ticket.generation = g = replace(g, seed=random.SystemRandom().randrange(2**63))
        ticket.key = next(self.keys)
        r = super().request(ticket)
        self.added.append([ticket.key, asdict(g)])
        return r

    def _serve(self):
        self.watchdog = Watchdog(lambda limit: self._fail(
            f"the tensor-parallel ranks did not answer in {limit:g} s (--rank-timeout "
            f"{self.timeout:g}): a rank is gone or stalled"))
        try:
            while self._round():
                pass
        except Exception as e:  # a collective failed (a rank is gone), or the ranks diverged
            self._fail(f"the tensor-parallel ranks are out of step: {e}")
        finally:
            self.watchdog.stop()
            self.done.set()

    def _round(self):
        """One plan exchanged and, unless it closes, one engine step; False once closed."""
        self.watchdog.beat(self.timeout)
        if leads():
            self._admit(block=not self.engine.busy)
            gone = self._cancel() if self.cancels else []
            plan = {}
            if self.added:
                plan["add"], self.added = self.added, []
            if gone:  # (a choice dropped: that choice's row alone)
                plan["cancel"] = [[r.ticket.key, r.choice] for r in gone]
            if self.engine.waiting:  # (BatchEngine.feedable reads the periods)
                plan["fastest"] = min(self.engine.periods, default=None)
            if self.closing:
                plan["close"] = True
            broadcast(plan or None, self.digest)
        else:
            plan = broadcast(None, self.digest) or {}
            self._follow(plan)
        if plan.get("close"):
            return False
        idle = not self.engine.busy  # (the same on every rank, the plan taken)
        self.watchdog.beat(STEP_TIMEOUTS * self.timeout)
        events = self._step()
        if leads():  # (the Load, /metrics' counters: rank 0's engine's)
            looked = self.look()
            self.deliver(events)
            self.flush(looked)
        self.digest = zlib.crc32(np.array([(e.request.ticket.key, e.request.choice, e.token)
                                           for e in events], np.int64).tobytes()) & 0x7FFFFFFF
        if idle:
            time.sleep(IDLE_TICK)
        return True

    def _follow(self, plan):
        """(the other ranks) Take rank 0's plan as rank 0 took it."""
        for key, g in plan.get("add", ()):
            if g["logit_bias"] is not None:  # JSON made its token ids strings
                g["logit_bias"] = {int(k): v for k, v in g["logit_bias"].items()}
            ticket = Ticket(Generation(**g))
            ticket.key = key
            try:  # (what fails here failed on rank 0 alike, and was answered there)
                self.engine.add(super().request(ticket))
            except Exception:
                pass
        if cancel := {tuple(c) for c in plan.get("cancel", ())}:
            # (rank 0's _cancel marked these among the same requests; one missing here is out of
            # step: the digest says)
            for r in self.engine.requests():
                if (r.ticket.key, r.choice) in cancel:
                    r.cancelled = True
        if "fastest" in plan:
            self.engine.periods.clear()
            if plan["fastest"] is not None:
                self.engine.periods.append(plan["fastest"])

    def _fail(self, reason):
        """The ranks are out of step for good: every request in flight fails with reason, the
        server takes no more (problem) and stops (fatal)."""
        if self.fatal is not None:
            return
        self.fatal = self.problem = reason
        if leads():
            error = RuntimeError(reason)
            for ticket in dict.fromkeys(r.ticket for r in self.engine.requests()):
                self.put(ticket, error)
            while not self.inbox.empty():
                self.put(self.inbox.get(), error)
        self.done.set()
