"""Prompt caches: a prompt's KV state kept so that a later prompt starting with the same tokens
prefills only the rest.

- In memory, across a server's requests (PromptCache): entries keyed by their token ids hold one
  (keys, values) pair per layer, each of shape (1, kv_heads, tokens, head_dim). A lookup takes the
  entry sharing the longest prefix with the prompt, whatever follows in either; eviction is least
  recently used, bounded by the bytes the entries hold.
- On disk, across runs (--prompt-cache-file: check_path, reuse, save): mlx-lm's prompt-cache format
  (mlx_lm.models.cache.save_prompt_cache: safetensors, the cache classes in its metadata) with three
  entries of ours in that metadata: the model it was made with, the prompt's token ids and the KV
  bits. It is written to a temporary file beside it and renamed into place, so a run cut short
  leaves the old file or none."""
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from .. import validate
from ..errors import UserError

def common_prefix(a, b):
    """The number of leading elements two int arrays share."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def token_rows(seqs):
    """Token id sequences as the rows of one int array, padded with -1 (shared_prefixes' table)."""
    rows = np.full((len(seqs), max(map(len, seqs), default=0)), -1, np.int64)
    for i, seq in enumerate(seqs):
        rows[i, :len(seq)] = seq
    return rows


def shared_prefixes(rows, tokens):
    """How many leading tokens each row of token_rows' table shares with tokens: a few array
    operations, not a loop over the rows."""
    n = min(len(tokens), rows.shape[1])
    if n == 0:
        return np.zeros(len(rows), np.int64)
    same = rows[:, :n] == np.asarray(tokens[:n], np.int64)
    return np.where(same.all(axis=1), n, same.argmin(axis=1))


class PromptCache:
    """An LRU map from token sequences to their per-layer KV state, at most max_bytes in all
    (0: nothing is kept)."""

    def __init__(self, max_bytes):
        self.max_bytes = max_bytes
        self.entries = OrderedDict()  # token ids -> (its Block, its row there), least recent first
        self.table = None  # (keys, their token ids as rows, their lengths): _shared
        # token ids -> the same as an int array (the table's rows, made once an entry)
        self.ids = {}
        self.nbytes = 0

    def __len__(self):
        return len(self.entries)

    def fetch(self, tokens):
        """(n, [(keys, values)] per layer holding tokens[:n]) for the longest cached prefix of
        tokens, n at most len(tokens) - 1: the last prompt token always runs, its logits give the
        first new token. (0, None) on a miss."""
        n, block, j = self.find(tokens)
        return (n, block.prefix(j, n)) if n else (0, None)

    def find(self, tokens):
        """fetch() without the copy's views: (n, the Block holding the prefix, its row there);
        (0, None, 0) on a miss. Rows of one block are taken together in one gather a layer."""
        if not self.entries:
            return 0, None, 0
        shared = np.minimum(self._shared(tokens), len(tokens) - 1)
        i = int(np.argmax(shared))
        if shared[i] <= 0:
            return 0, None, 0
        best = self.table[0][i]
        self.entries.move_to_end(best)
        return int(shared[i]), *self.entries[best]

    def _shared(self, tokens):
        """How many leading tokens each entry shares with tokens, in the order of self.table: the
        entries' token ids as rows of one array (padded with -1), built again after a change, so
        that a lookup among hundreds of entries is a few array operations, not a loop over them."""
        if self.table is None:
            keys = list(self.ids)  # (not hashed again: a key of hundreds of ids costs as many)
            self.table = (keys, token_rows(list(self.ids.values())),
                          np.array([len(key) for key in keys]))
        return shared_prefixes(self.table[1], tokens)

    def store(self, tokens, kv):
        """Keep kv ([(keys, values)] per layer, over exactly tokens) as the most recent entry. An
        entry whose tokens begin this one is superseded and dropped; if a kept entry already begins
        with these tokens, nothing changes but its recency."""
        if kv and kv[0][0].shape[2] != len(tokens):
            raise ValueError(f"a KV state of {kv[0][0].shape[2]} positions stored for "
                             f"{len(tokens)} tokens")
        self.store_rows([tokens], kv, [0])

    def store_rows(self, seqs, kv, rows):
        """store() for several sequences at once: seqs[j] is held by row rows[j] of kv ([(keys,
        values)] per layer, (rows, heads, positions, dim), at least len(seqs[j]) positions). They
        are copied out in one gather per layer (a batch's rows leaving together: not a copy per row
        and layer), and their entries share that block, counted in nbytes until the last of them
        goes. Where the block would not fit max_bytes, the last sequences that fit are kept."""
        if self.max_bytes <= 0:
            return
        kept = {}  # key -> its row
        for tokens, row in zip(seqs, rows):
            key = tuple(tokens)
            if not key or key in kept:
                continue
            if self.entries:
                shared, (keys, _, lengths) = self._shared(key), self.table
                # an entry begins with these tokens
                if (longer := np.flatnonzero(shared == len(key))).size:
                    self.entries.move_to_end(keys[longer[0]])
                    continue
                for i in np.flatnonzero(shared == lengths):  # these tokens begin with it
                    self._drop(keys[i])
            kept[key] = row
        per = sum(k.shape[1] * k.shape[3] * k.dtype.size + v.shape[1] * v.shape[3] * v.dtype.size
                  for k, v in kv)
        # the latest that fit
        while kept and len(kept) * max(map(len, kept)) * per > self.max_bytes:
            del kept[next(iter(kept))]
        if not kept:
            return
        n, index = max(map(len, kept)), mx.array(list(kept.values()))
        block = [(k[index, :, :n, :], v[index, :, :n, :]) for k, v in kv]  # copies, not views of kv
        size = len(kept) * n * per  # the block's bytes
        mx.async_eval(block)  # the copies queued, not waited for: the batch's queued step runs on
        shares = Block(block, size, len(kept))
        # an entry is its block's row j, cut to length by fetch, not a view a layer made here:
        # 1,920 arrays for 32 rows of 30 layers
        for j, key in enumerate(kept):
            self.entries[key] = (shares, j)
            self.ids[key] = np.array(key, np.int64)
        self.table = None
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key):
        shares, _ = self.entries.pop(key)
        del self.ids[key]
        self.table = None
        shares.entries -= 1
        if not shares.entries:
            self.nbytes -= shares.nbytes


@dataclass(eq=False)
class Block:
    """A gathered copy ([(keys, values)] per layer, a row per entry), its bytes and how many entries
    still hold it. Compared and hashed by identity."""
    kv: list
    nbytes: int
    entries: int

    def prefix(self, j, n):
        """Row j's first n positions, [(keys, values)] per layer (views)."""
        return [(k[j:j + 1, :, :n, :], v[j:j + 1, :, :n, :]) for k, v in self.kv]


# ---------------------------------------------------------------- on disk (--prompt-cache-file)

SUFFIX = ".safetensors"


def check_path(path):
    """path as a prompt cache file's: named *.safetensors in a folder that exists, and a regular
    file this process can read where something is there already (a FIFO, a folder, a link loop or
    an unreadable file is a one-line error: validate.check_file)."""
    path = Path(path)
    if path.suffix != SUFFIX:
        raise UserError(f"{path}: a prompt cache file's name must end in {SUFFIX}")
    if not path.parent.is_dir():
        raise UserError(f"{path.parent}: no such folder for the prompt cache file")
    if validate.present(path):
        validate.check_file(path)
    return path


def reuse(path, model, model_id, tokens, kv_bits=None):
    """(cache, kept): the cache in the file trimmed to the longest prefix its prompt shares with
    `tokens` (never all of them: the last prompt token must be fed to get logits), and that
    prefix's length; (None, 0) when there is no file yet."""
    path = check_path(path)
    if not validate.present(path):
        return None, 0
    try:
        cache, meta = load_prompt_cache(str(path), return_metadata=True)
        cached = json.loads(meta["tokens"])
        saved_for, saved_bits = meta["model"], meta["kv_bits"]
    except Exception as e:
        raise UserError(f"{path}: not a prompt cache file of ours ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else 'no detail'}); "
                        "delete it or pass another")
    if saved_for != model_id or len(cache) != len(model.layers):
        raise UserError(f"{path} holds the prompt cache of model {saved_for}, not of {model_id}: "
                        "pass another --prompt-cache-file or delete this one")
    if saved_bits != str(kv_bits):
        raise UserError(f"{path} was saved with --kv-bits {saved_bits}, this run has {kv_bits}: "
                        "pass the same --kv-bits or another file")
    kept = common_prefix(cached, tokens[:-1])
    if not all(c.is_trimmable() for c in cache):
        if kept < len(cached):
            raise UserError(f"{path}: its rotating cache cannot be cut back to the {kept} prompt "
                            "tokens this prompt shares with it; delete it or pass another file")
    for c in cache:
        c.trim(c.offset - kept)
    return cache, kept


def save(path, cache, model_id, tokens, kv_bits=None):
    """Write the cache, cut back to the prompt `tokens` (a generation leaves its own tokens in it),
    atomically. Returns False (nothing written) when the cache cannot be cut back (a rotating cache
    that has wrapped around)."""
    path = check_path(path)
    extra = cache[0].offset - len(tokens)
    if extra > 0 and not all(c.is_trimmable() for c in cache):
        return False
    for c in cache:
        c.trim(extra)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{SUFFIX}")
    try:
        save_prompt_cache(str(tmp), cache, {"model": model_id, "tokens": json.dumps(list(tokens)),
                                            "kv_bits": str(kv_bits)})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return True
