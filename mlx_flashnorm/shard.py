"""Tensor parallelism over mx.distributed (issue 33): a model split over the N processes that
`mlx.launch -n N` starts, gpt-fast style: module swaps from outside the model files.

Each attention's heads and each FFN's hidden columns are split over the ranks:
- column-parallel (split): q/k/v_proj, gate/up_proj. Their output rows are sliced per rank:
  rank r keeps query heads [r*H/N, (r+1)*H/N) and the same share of the key/value heads (GQA
  groups stay whole), and its share of the FFN columns. A concatenated linear (concat.py's
  qkv_proj and gate_up_proj, OpenELM's qkv_proj and proj_1) is sliced per part: q | k | v per
  head group, gate | up per half, so that project()/heads() still cut its output at the
  module's (now local) head counts and halves.
- row-parallel (split + connect): o_proj/out_proj, down_proj/proj_2 keep their input columns of
  the same share and sum their partial products over the ranks (all_sum) before any deferred
  scale and bias, which are applied once, after the sum.
The attention modules' n_heads and n_kv_heads become the local counts. Every norm stays whole:
the residual stream is full on every rank. Where the vocabulary divides over the ranks, the
embedding and an untied LM head are split by vocabulary rows too (vocab-parallel): a rank looks up
the tokens of its rows and the ranks sum the lookups (the others add zeros: exact), and each rank
computes its rows' logits, gathered in rank order (a tied head is the embedding's as_linear); so a
rank holds about 1/N of all the weights, not only of the blocks'.

FlashNorm needs nothing more: the deferred 1/RMS is one scalar per token, computed from the full
residual stream that every rank holds, so the column-parallel shards apply it locally, and the
FFN's deferred scale is applied after the row-parallel sum (AllSumLinear sums inside the matmul).
The flash modules (flashnorm.py) keep the same attribute names as the reference ones (n_heads,
n_kv_heads, q/k/v_proj or qkv_proj, gate/up_proj or gate_up_proj or proj_1, o_proj/out_proj,
down_proj/proj_2), so split() serves both forms; their norm gains act on the full input and the
QK-norm tables on head_dim, which the split leaves whole. The fused kernels are shape-generic:
they run on the local head counts and widths.

loader.load() calls split() right after the checkpoint's arrays are attached and before they
are read (safetensors are read lazily, so each rank reads one full tensor at a time and keeps its
slice), and connect() after prepare(); shard() does both for a model already loaded."""
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from .concat import GATE_UP, PER_OUTPUT, QKV, held
from .errors import UserError
from .flashnorm import DeferredLinear, QuantizedDeferredLinear, deferred, unstack

ROW = ("o_proj", "out_proj", "down_proj", "proj_2")  # the row-parallel linears, by name
FFN_UP = (GATE_UP, ("proj_1",))  # the column-parallel linears of an FFN: parts, or OpenELM's


@lru_cache(maxsize=None)
def world():
    """The group of the processes `mlx.launch` started (any backend MLX offers), or None where this
    process runs alone."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def in_width(linear):
    """The input width of a linear, full precision or quantized (packed 32-bit words)."""
    width = linear["weight"].shape[1]
    return width * 32 // linear.bits if "scales" in linear else width


def _rows(linear, blocks):
    """Keep the output rows [start, start + n) of each block (start, n), in order, of every per-
    output array of linear (mx.contiguous: a copy, so the full array can be freed)."""
    for name in PER_OUTPUT & set(linear):
        a = linear[name]
        linear[name] = mx.contiguous(mx.concatenate([a[s:s + n] for s, n in blocks])
                                     if len(blocks) > 1
                                     else a[blocks[0][0]:blocks[0][0] + blocks[0][1]])


def _whole_groups(n, g, where):
    if n % g:
        raise UserError(f"{where}: its {n} input columns per process are not whole quantization "
                        f"groups of {g}; use a number of processes that divides them, or a "
                        "smaller --group-size")


def _columns(linear, start, n, where, group_size=None):
    """Keep the input columns [start, start + n) of linear (its bias, added after the sum, stays
    whole). A quantized linear is cut at whole quantization groups; group_size: the linear is to
    be quantized so (load's bits), which needs whole groups too, or its shard would stay
    unquantized."""
    if group_size and "scales" not in linear and in_width(linear) % group_size == 0:
        _whole_groups(n, group_size, where)
    if "scales" in linear:
        g = linear.group_size
        _whole_groups(n, g, where)  # start = rank * n: whole groups too
        words = 32 // linear.bits
        linear["weight"] = mx.contiguous(linear["weight"][:, start // words:(start + n) // words])
        for name in ("scales", "biases"):
            if name in linear:
                linear[name] = mx.contiguous(linear[name][:, start // g:(start + n) // g])
    else:
        linear["weight"] = mx.contiguous(linear["weight"][:, start:start + n])


def _share(total, rank, size, what, where):
    if total % size:
        raise UserError(f"{where}: its {total} {what} do not divide over {size} processes; "
                        "run on a number of processes that divides every layer's head counts "
                        "and FFN width")
    n = total // size
    return rank * n, n


def split_attention(attn, rank, size, where, group_size=None):
    """Keep rank's share of the attention's heads: q/k/v rows per head group, o_proj columns."""
    h, nq, nkv = attn.head_dim, attn.n_heads, attn.n_kv_heads
    q0, q = _share(nq, rank, size, "query heads", where)
    k0, k = _share(nkv, rank, size, "key/value heads", where)
    q_rows, kv_rows = (q0 * h, q * h), (k0 * h, k * h)
    parts = held(attn, QKV)
    if len(parts) == 1:  # one qkv_proj: q | k | v
        _rows(attn[parts[0]], [q_rows, (nq * h + k0 * h, k * h), ((nq + nkv) * h + k0 * h, k * h)])
    else:
        for p, rows in zip(QKV, (q_rows, kv_rows, kv_rows)):
            _rows(attn[p], [rows])
    out = "o_proj" if "o_proj" in attn else "out_proj"
    _columns(attn[out], q0 * h, q * h, f"{where}.{out}", group_size)
    attn.n_heads, attn.n_kv_heads = q, k


def split_ffn(ffn, rank, size, where, group_size=None):
    """Keep rank's share of the FFN's hidden columns: gate/up rows (per half where concatenated),
    down columns."""
    down = "down_proj" if "down_proj" in ffn else "proj_2"
    hidden = in_width(ffn[down])
    start, n = _share(hidden, rank, size, "FFN columns", where)
    for parts in FFN_UP:
        names = held(ffn, parts)
        if all(p in ffn for p in names):
            break
    if len(names) == 1:  # gate | up in halves
        _rows(ffn[names[0]], [(start, n), (hidden + start, n)])
    else:
        for p in names:
            _rows(ffn[p], [(start, n)])
    _columns(ffn[down], start, n, f"{where}.{down}", group_size)


def split(model, rank, size, group_size=None):
    """Keep rank's share (of size) of every attention's heads and every FFN's columns, in place
    (the reference modules or FlashNorm's, quantized or not); returns the model. The head counts
    must divide: a UserError names a layer where they do not (OpenELM's vary per
    layer). The arrays are not evaluated here: load() reads them afterwards, slice by slice.
    group_size: the model is to be quantized with it afterwards (prepare's bits), so a row-parallel
    linear's columns must be whole groups of it, as they are in one process."""
    if size == 1:
        return model
    # a loaded model's stacked matrices (flashnorm.stack_weights) would keep every rank's whole
    unstack(model)
    for path, m in model.named_modules():
        if isinstance(getattr(m, "n_heads", None), int) and ("o_proj" in m or "out_proj" in m):
            split_attention(m, rank, size, path, group_size)
        elif "down_proj" in m or "proj_2" in m:
            split_ffn(m, rank, size, path, group_size)
    vocab = model.args.vocab_size
    if vocab % size == 0 and model.embed_tokens["weight"].shape[0] == vocab:
        rows = [(rank * vocab // size, vocab // size)]
        _rows(model.embed_tokens, rows)
        if "lm_head" in model:
            _rows(model.lm_head, rows)
    return model


class _AllSum:
    """A row-parallel linear: its partial product summed over the group, then the deferred scale
    and bias of _Deferred.__call__, once."""

    group = None

    def _product(self, x):
        return mx.distributed.all_sum(super()._product(x), group=self.group)


class AllSumLinear(_AllSum, DeferredLinear):
    pass


class QuantizedAllSumLinear(_AllSum, QuantizedDeferredLinear):
    pass


def all_sum_linear(linear, group):
    """The row-parallel form of a (sliced) linear: the same arrays in an AllSumLinear or
    QuantizedAllSumLinear (a plain linear computes as the deferred one without scale)."""
    if not isinstance(linear, (DeferredLinear, QuantizedDeferredLinear)):
        linear = deferred(linear)
    linear.__class__ = (QuantizedAllSumLinear if isinstance(linear, QuantizedDeferredLinear)
                        else AllSumLinear)
    linear.group = group
    return linear


def gathered(y, group):
    """The whole last axis of y from each rank's slice of it, in rank order."""
    return mx.moveaxis(mx.distributed.all_gather(mx.moveaxis(y, -1, 0), group=group), 0, -1)


class _VocabRows:
    """An embedding holding the vocabulary rows [start, start + its rows): a lookup of the tokens
    outside them gives zeros, and the ranks' lookups are summed; as a linear (a tied head) it gives
    its rows' logits, gathered from every rank."""

    group, start = None, 0

    def __call__(self, x):
        local = x - self.start
        inside = (local >= 0) & (local < self["weight"].shape[0])
        h = super().__call__(mx.where(inside, local, 0))
        return mx.distributed.all_sum(mx.where(inside[..., None], h, 0), group=self.group)

    def as_linear(self, x):
        return gathered(super().as_linear(x), self.group)


@lru_cache(maxsize=None)
def _vocab_rows_class(cls):
    """cls (nn.Embedding, nn.QuantizedEmbedding or the CPU's kernels.QuantizedEmbedding) holding
    vocabulary rows."""
    return type(f"VocabRows{cls.__name__}", (_VocabRows, cls), {})


class GatheredHead(nn.Module):
    """An untied LM head holding the vocabulary rows of its rank: its logits gathered from every
    rank."""

    def __init__(self, head, group):
        super().__init__()
        self.head, self.group = head, group

    def __call__(self, x):
        return gathered(self.head(x), self.group)


def connect(model, group):
    """Make every row-parallel linear (ROW) of a split model sum over group, a vocab-split
    embedding and LM head gather over it, in place, and seed every rank's random generator with
    rank 0's seed: the logits are the same on every rank (the sums are), so sampling then draws the
    same tokens everywhere. Returns the model."""
    for _, m in model.named_modules():
        for name in ROW:
            if name in m and isinstance(m[name], nn.Module) and not isinstance(m[name], _AllSum):
                m[name] = all_sum_linear(m[name], group)
    rows, embedding = model.embed_tokens["weight"].shape[0], model.embed_tokens
    if rows < model.args.vocab_size and not isinstance(embedding, _VocabRows):
        embedding.__class__ = _vocab_rows_class(type(embedding))
        embedding.group, embedding.start = group, group.rank() * rows
        head = model.get("lm_head")
        if isinstance(head, nn.Module) and "weight" in head and head["weight"].shape[0] == rows:
            model.lm_head = GatheredHead(head, group)
    seed = mx.random.randint(0, 2**31 - 1, (1,)) if group.rank() == 0 else mx.zeros((1,), mx.int32)
    mx.random.seed(mx.distributed.all_sum(seed.astype(mx.int32), group=group).item())
    return model


def shard(model, group=None):
    """split() and connect() a loaded model over group (default: world()); the model as it is where
    there is no group. Each rank frees the rest of each array once its slice is evaluated."""
    group = group or world()
    if group is None:
        return model
    split(model, group.rank(), group.size())
    mx.eval(model.parameters())
    return connect(model, group)
