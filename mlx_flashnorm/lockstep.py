"""The processes of a tensor-parallel model (shard.py) take the same steps: rank 0 reads the input
and prints; every other rank (a follower) runs the same generations in the same order, since each
step's row-parallel sums pair the ranks' operations one to one.

The logits are the same on every rank (each sum is), and shard.connect seeded every rank's random
generator alike, so the ranks sample the same tokens; lockstep() checks that after each token.
What only rank 0 knows is handed on with broadcast(): a chat's input lines (shared), each step's
plan of the server's batch (serve/lockstep_worker.py), with a check that the ranks computed alike.
A rank that stops answering leaves the others waiting in a sum that has no timeout of its own: a
Watchdog ends the wait. Outside `mlx.launch -n N` (N > 1) every function here is the plain
single-process behaviour."""
import json
import os
import sys
import threading
import time
from contextlib import closing

import mlx.core as mx
import numpy as np

from .shard import world

DIVERGED = ("the tensor-parallel ranks generated different tokens: they do not share a random "
            "state, or a step's plan")


def leads():
    """True on rank 0, and where this process runs alone."""
    group = world()
    return group is None or group.rank() == 0


def quiet():
    """A follower prints nothing: its standard output goes to the null device (rank 0 prints for
    all; `mlx.launch` would show every rank's output)."""
    if not leads():
        sys.stdout = open(os.devnull, "w")


def _from_leader(values):
    """rank 0's int32 values on every rank: a sum to which the followers add zeros."""
    return mx.distributed.all_sum(values if leads() else mx.zeros_like(values), group=world())


def broadcast(obj=None, check=0):
    """rank 0's obj (anything JSON writes; None: nothing past one small exchange) on every rank;
    the followers pass nothing. check: a number below 2**31 that every rank computed alike (a
    digest of its tokens), exchanged in that small step: where the ranks' differ every rank raises
    RuntimeError, so none waits on another."""
    if world() is None:
        return obj
    data = json.dumps(obj).encode() if leads() and obj is not None else b""
    head = np.array(mx.distributed.all_gather(mx.array([[len(data), check]], mx.int32),
                                              group=world()))
    if (head[:, 1] != head[0, 1]).any():
        raise RuntimeError(DIVERGED)
    if not head[0, 0]:
        return None
    values = (mx.array(np.frombuffer(data, np.uint8).astype(np.int32)) if leads()
              else mx.zeros((int(head[0, 0]),), mx.int32))
    return json.loads(np.array(_from_leader(values)).astype(np.uint8).tobytes())


def shared(read):
    """read() on rank 0 (an input line, say), its value (or its EOFError) on every rank."""
    if world() is None:
        return read()
    value = None
    if leads():
        try:
            value = {"value": read()}
        except EOFError:
            value = {"eof": True}
    value = broadcast(value)
    if "eof" in value:
        raise EOFError
    return value["value"]


def _agree(token, stop):
    """Whether rank 0 stops (its consumer's stop flag), the same on every rank; every rank raises
    where the ranks' tokens differ (a diverged random state), so none waits on another."""
    state = np.array(mx.distributed.all_gather(mx.array([[token, int(stop and leads())]], mx.int32),
                                               group=world()))
    if (state[:, 0] != state[0, 0]).any():
        raise RuntimeError(DIVERGED)
    return bool(state[0, 1])


def lockstep(responses):
    """Yield the Responses of a stream_generate, on every rank, ending on every rank where rank 0's
    consumer stops (closes this generator): after each token the ranks exchange it and rank 0's
    decision to go on. Each rank has then run the same steps (generate_step queues the next one
    before it yields a token, on every rank alike)."""
    if world() is None:
        yield from responses
        return
    with closing(responses):
        for r in responses:
            stop = False
            try:
                yield r
            except GeneratorExit:  # rank 0's consumer stopped (a follower's never does)
                stop = True
            if _agree(r.token, stop) or r.finish_reason is not None:
                break


class Watchdog:
    """Calls expired(limit) once, on a thread of its own, where the next beat() did not come within
    the `limit` seconds the last one gave: a rank waiting in a sum for a rank that is gone waits
    for ever (MLX's ring backend reports a lost peer to a sum under way at most: the next one
    waits; NCCL's wait has no end either). stop() disarms it."""

    def __init__(self, expired):
        self.expired, self.due, self.limit, self.stopped = expired, float("inf"), None, False
        threading.Thread(target=self._watch, daemon=True).start()

    def beat(self, limit):
        self.due, self.limit = time.monotonic() + limit, limit

    def stop(self):
        self.stopped = True

    def _watch(self):
        while not self.stopped:
            left = self.due - time.monotonic()
            if left <= 0:
                return self.expired(self.limit)
            time.sleep(min(left, 1.0))


def abandon(message):
    """Exit at once with status 1, message on standard error: a rank out of step may have a thread
    waiting in a sum that cannot be cancelled, on which a normal exit would wait or abort."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)
