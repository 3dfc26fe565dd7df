"""A prompt (prefix) cache across requests: the KV state of token sequences the model has already
read, so that a request whose prompt starts with one of them (a shared system prompt, a
conversation's earlier turns and replies) prefills only the rest.

Entries are keyed by their token ids and hold one (keys, values) pair per layer, each of shape
(1, kv_heads, tokens, head_dim). A lookup takes the entry sharing the longest prefix with the
prompt, whatever follows in either; eviction is least recently used, bounded by the bytes the
entries hold."""
from collections import OrderedDict

import mlx.core as mx
import numpy as np


def common_prefix(a, b):
    """The number of leading elements two int arrays share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PromptCache:
    """An LRU map from token sequences to their per-layer KV state, at most max_bytes in all
    (0: nothing is kept)."""

    def __init__(self, max_bytes):
        self.max_bytes = max_bytes
        self.entries = OrderedDict()  # tuple of token ids -> (np token array, [(keys, values)] per layer)
        self.nbytes = 0

    def __len__(self):
        return len(self.entries)

    def fetch(self, tokens):
        """(n, [(keys, values)] per layer holding tokens[:n]) for the longest cached prefix of
        tokens, n at most len(tokens) - 1: the last prompt token always runs, its logits give the
        first new token. (0, None) on a miss."""
        ids = np.asarray(tokens)
        best, n = None, 0
        for key, (arr, _) in self.entries.items():
            m = min(common_prefix(arr, ids), len(ids) - 1)
            if m > n:
                best, n = key, m
        if best is None:
            return 0, None
        self.entries.move_to_end(best)
        return n, [(k[..., :n, :], v[..., :n, :]) for k, v in self.entries[best][1]]

    def store(self, tokens, kv):
        """Keep kv ([(keys, values)] per layer, over exactly tokens) as the most recent entry. An
        entry whose tokens begin this one is superseded and dropped; if a kept entry already begins
        with these tokens, nothing changes but its recency."""
        key = tuple(tokens)
        if kv and kv[0][0].shape[2] != len(key):
            raise ValueError(f"a KV state of {kv[0][0].shape[2]} positions stored for {len(key)} tokens")
        if not key or self.max_bytes <= 0:
            return
        for old in list(self.entries):
            if old[:len(key)] == key:
                self.entries.move_to_end(old)
                return
            if key[:len(old)] == old:
                self._drop(old)
        kv = [(mx.contiguous(k), mx.contiguous(v)) for k, v in kv]  # not a view of a larger buffer
        size = sum(k.nbytes + v.nbytes for k, v in kv)
        if size > self.max_bytes:
            return
        mx.eval(kv)
        self.entries[key] = (np.asarray(key), kv)
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key):
        _, kv = self.entries.pop(key)
        self.nbytes -= sum(k.nbytes + v.nbytes for k, v in kv)
