"""Prompt caches: a prompt's KV state kept so that a later prompt starting with the same tokens
prefills only the rest.

- In memory, across a server's requests (PromptCache): entries keyed by their token ids hold one
  (keys, values) pair per layer, each of shape (1, kv_heads, tokens, head_dim). A lookup takes the
  entry sharing the longest prefix with the prompt, whatever follows in either; eviction is least
  recently used, bounded by the bytes the entries hold.
- On disk, across runs (--prompt-cache-file: check_path, reuse, save): mlx-lm's prompt-cache format
  (mlx_lm.models.cache.save_prompt_cache: safetensors, the cache classes in its metadata) with four
  entries of ours in that metadata: the model it was made with (--model), the fingerprint of its
  files and load settings (loader.fingerprint), the prompt's token ids and the KV bits. What it
  holds is checked against them and against the model before it is used (check). It is written to
  a temporary file beside it and renamed into place, so a run cut short leaves the old file or
  none."""
import copy
import json
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import save_prompt_cache

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


class Stale(Exception):
    """A prompt cache file of ours that must not be used: its message says why."""


def reuse(path, model, model_id, tokens, fresh):
    """(cache, kept): the cache in the file trimmed to the longest prefix its prompt shares with
    `tokens` (never all of them: the last prompt token must be fed to get logits), and that
    prefix's length; (None, 0) when there is no file yet. fresh: the empty cache this run makes
    (decoding.eager_cache), whose kind the file's must be.

    A file of ours that does not match this model and run (check: the fingerprint of the weights,
    tokenizer and load settings, the token ids, the cache kinds, each array's shape and dtype, the
    positions held, finite values) is not used: a one-line note on stderr says why, and save()
    replaces it. A file that is not a prompt cache of ours, or one saved for another --model or
    --kv-bits, is an error, and never overwritten."""
    path = check_path(path)
    if not validate.present(path):
        return None, 0
    kv_bits = getattr(fresh[0], "bits", None)
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
        saved_for, saved_bits = meta["0.model"], meta["0.kv_bits"]
    except Exception as e:
        raise UserError(f"{path}: not a prompt cache file of ours ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else 'no detail'}); "
                        "delete it or pass another")
    if saved_for != model_id:
        raise UserError(f"{path} holds the prompt cache of model {saved_for}, not of {model_id}: "
                        "pass another --prompt-cache-file or delete this one")
    if saved_bits != str(kv_bits):
        raise UserError(f"{path} was saved with --kv-bits {saved_bits}, this run has {kv_bits}: "
                        "pass the same --kv-bits or another file")
    try:
        cache, cached = check(arrays, meta, model, fresh)
    except Stale as e:
        print(f"note: {path}: {e}; not used (this run's save overwrites it)", file=sys.stderr)
        return None, 0
    kept = common_prefix(cached, tokens[:-1])
    if not all(c.is_trimmable() for c in cache):
        if kept < len(cached):
            raise UserError(f"{path}: its rotating cache cannot be cut back to the {kept} prompt "
                            "tokens this prompt shares with it; delete it or pass another file")
    for c in cache:
        c.trim(c.offset - kept)
    return cache, kept


SETTINGS = ("group_size", "bits", "keep", "max_size")  # a cache kind's settings, which must agree


def check(arrays, meta, model, fresh):
    """(cache, its token ids) from a prompt cache file's arrays and metadata (mx.load's), checked
    against the model and the empty cache this run makes (fresh), or Stale saying what does not
    match. The file's layout is taken from fresh's, not from its own metadata: each layer's state
    is that of a cache of fresh's kind that read a token, array for array, the same but for the
    positions (axis 2)."""
    if meta.get("0.fingerprint") != getattr(model, "fingerprint", None):
        raise Stale("it was made from other weights, tokenizer or load settings than this "
                    "model's (the files at this path changed, or the flags did)")
    try:
        cached = json.loads(meta["0.tokens"])
    except (KeyError, ValueError, RecursionError):
        raise Stale("its 'tokens' entry is not JSON") from None
    vocab = model.args.vocab_size
    if not (isinstance(cached, list) and cached
            and all(type(t) is int and 0 <= t < vocab for t in cached)):
        raise Stale(f"its 'tokens' entry is not a list of token ids below {vocab}")
    kinds = [type(c).__name__ for c in fresh]
    if [meta.get(f"1.{i}") for i in range(len(fresh) + 1)] != [*kinds, None]:
        raise Stale(f"it does not hold {len(fresh)} layers of {kinds[0]}, as this run's cache")
    probe = copy.deepcopy(fresh)  # its arrays' shapes and dtypes: a graph, never evaluated
    model(mx.zeros((1, 1), mx.int32), cache=probe)
    leaves = [(f"{i}.{key}", want) for i, c in enumerate(probe) for key, want in
              tree_flatten(c.state)]
    if set(arrays) != {name for name, _ in leaves}:
        raise Stale("its arrays are not those of this model's caches")
    cache, finite = [], []
    for i, (c, made) in enumerate(zip(probe, fresh)):
        state = []
        for key, want in tree_flatten(c.state):
            got = arrays[f"{i}.{key}"]
            if isinstance(want, mx.array):
                if got.dtype != want.dtype or got.ndim != want.ndim or \
                        got.shape[:2] + got.shape[3:] != want.shape[:2] + want.shape[3:]:
                    raise Stale(f"its layer {i} holds an array of shape {got.shape} and dtype "
                                f"{got.dtype}, this model's has {want.shape[:2]} (positions) "
                                f"{want.shape[3:]} and {want.dtype}")
                state.append((key, got))
            elif got.ndim != 0 or not mx.issubdtype(got.dtype, mx.integer):
                raise Stale(f"its layer {i}'s entry {key} is not a number")
            else:
                state.append((key, got.item()))
        restored = type(made).from_state(tree_unflatten(state))
        if any(getattr(restored, k) != getattr(made, k) for k in SETTINGS if hasattr(made, k)):
            raise Stale(f"its layer {i} is a {kinds[i]} of other settings than this run's")
        keys = restored.keys[0] if isinstance(restored.keys, (list, tuple)) else restored.keys
        held = min(restored.offset, getattr(restored, "max_size", restored.offset))
        if restored.offset != len(cached) or keys.shape[2] < held \
                or not 0 <= getattr(restored, "_idx", 0) <= keys.shape[2]:
            raise Stale(f"its layer {i} holds {keys.shape[2]} positions at offset "
                        f"{restored.offset}, for {len(cached)} tokens")
        finite += [mx.isfinite(a[:, :, :held]).all() for _, a in state
                   if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating)]
        cache.append(restored)
    if not mx.stack(finite).all().item():
        raise Stale("its keys or values hold NaN or infinite values")
    return cache, cached


def save(path, cache, model, model_id, tokens):
    """Write the cache, cut back to the prompt `tokens` (a generation leaves its own tokens in it),
    with the model's fingerprint (loader.fingerprint), atomically. Returns False (nothing written)
    when the cache cannot be cut back (a rotating cache that has wrapped around)."""
    path = check_path(path)
    extra = cache[0].offset - len(tokens)
    if extra > 0 and not all(c.is_trimmable() for c in cache):
        return False
    for c in cache:
        c.trim(extra)
    meta = {"model": model_id, "tokens": json.dumps(list(tokens)),
            "kv_bits": str(getattr(cache[0], "bits", None))}
    if getattr(model, "fingerprint", None) is not None:
        meta["fingerprint"] = model.fingerprint
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{SUFFIX}")
    try:
        save_prompt_cache(str(tmp), cache, meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return True
