"""decode_rows: kernels.decode_layers for a batch, B rows each at its own position (the batched
server's step, batch_cache.RowsKVCache), in one persistent CUDA launch of NW warps a block (WARPS).

The one-row kernel's phases (step.py) with every matvec on the tensor cores: a block takes a tile of
16 weight rows, its warps split the input into spans of 32 values (mma m16n8k8 in tf32, G input rows
at once), and their partial sums are added in a fixed order. A packed 4- or 8-bit value is exact in
tf32, and so is a full-precision float16 or bfloat16 weight (a float32 one is split as an input
is), and each input is split into two tf32 parts, so a product keeps 21 bits or more; the sum's
order is the mma's, not the one-row kernel's (the batched step's tokens are the one-request tokens
where no two logits are within float32 rounding: the GPU tests check it). A row's output does not
depend on the other rows (each mma column is its own row), so a request decodes alike at any batch
size. Rows go in passes (launch_plan); a matvec phase's items, (pass, tile), are spread over the
grid, item i of pass i % passes, so a block's next item (i + grid) keeps its input rows. The rows
between phases live in device memory as T (the one-row kernel rounds them there); o_proj's and
down_proj's stores add their outputs to the residual stream (down_proj's times its deferred scale)
once; each row's 1/RSSe and deferred scale are written by the block of its pass's first tile. A
phase waits for its rows' loads: 16 bytes a load, several in flight, and under them a tile's first
span (weights, scales, biases: a load from device memory each phase waited for after its rows) and,
in passes of 8 rows, the norms' gains; gate/up's two tiles give their spans to the warps from
opposite ends, so that each warp takes about as many (the CUDA: cuda/rows.cu). Attention is split
over (row, kv head, split of positions), capped so that the batch's items about fill the grid once;
a row's splits are merged in a phase of their own, which a batch of one split a row skips (its
blocks write their outputs). Its plain-MLX reference runs step._reference row by row.

On CUDA (sm_80 on) it runs only after its self-check (CHECK) passed; the GPU tests in
tests/test_step_kernel.py check it against the reference and against one-request decoding
(bench/RESULTS.md, "GPU tests")."""
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from .build import make_kernel, rand
from . import stacks, step

BMAX = step.MAX_ROWS
GMAX = 16  # rows per pass, at most (bench/RESULTS.md, "The batched step": passes of 32 were slower)
WARPS = 12  # NW, a block's warps (bench/RESULTS.md, "The batched step": 8, 12 and 16 compared)
# dynamic shared bytes a launch asks for at most (and within step.shared_limit)
SHARED_MAX = 160 * 1024
CUDA = Path(__file__).parent / "cuda"  # rows.cu and whole_step.cuh (a copy of this file: beside it)
# dims: the one-row kernel's, then the rows, and whether they are one sequence's (prefill_rows)
SIZES = step.SIZES + (("B", "int"), ("prefill", "bool"))


def source(layers):
    """decode_rows' CUDA for `layers` layers: (body, header) as make_kernel takes them."""
    return step.compose(CUDA, "rows.cu", SIZES, layers, own=("device", "body"))



def rows_per_pass(B, xa, xi, limit=SHARED_MAX):
    """(G, GD, IC): the rows one matvec pass takes, 8 or 16 (GMAX; the tensor cores' groups of 8):
    16 beyond 16 rows where the dynamic shared memory (limit) holds it, else 8 (at 16 rows two
    passes of 8 fill more of the grid than one of 16 and take a shorter step: bench/RESULTS.md,
    "The batched step"): G for the inputs of xa values (K or HQ * D), GD (at most G) for
    down_proj's xi (I), IC values at a time (all, or the fewest chunks of multiples of 32 that
    fit); or None."""
    if dynamic_bytes(8, 8, xa, 32) > limit:
        return None
    G = 8
    while G < GMAX and 2 * G < B and dynamic_bytes(2 * G, 8, xa, 32) <= limit:
        G *= 2
    GD = G
    while GD > 8 and dynamic_bytes(G, GD, xa, xi) > limit:
        GD //= 2
    chunks, IC = 1, xi
    while dynamic_bytes(G, GD, xa, IC) > limit:
        chunks += 1
        IC = 32 * -(-xi // (32 * chunks))
    return G, GD, IC


def gate_up_rows(B, G, GD, xa, IC, limit=SHARED_MAX):
    """GU, gate/up's rows per pass: 16 where G is 8, the batch has more and the shared memory holds
    them, else G (passes of 32 made a 64-row step slower: bench/RESULTS.md, "The batched step")."""
    return 16 if G == 8 and B > 8 and dynamic_bytes(16, GD, xa, IC) <= limit else G


def dynamic_bytes(G, GD, xa, xi):
    """Dynamic shared memory: G input rows of xa values (or GD of xi), padded by 4; two tiles'
    partial sums."""
    return 4 * (max(G * (xa + 4), GD * (xi + 4)) + 2 * WARPS * (G // 8) * 128)


def shared_bytes(G, GD, GU, xa, xi, D, GQ, L):
    """dynamic_bytes (GU rows: G or more), or the attention's warps' values where more (they take
    that space between the matvecs), at least 48004 where it and static_bytes pass 48 KB
    (step.shared_bytes)."""
    dynamic = max(dynamic_bytes(GU, GD, xa, xi), 4 * WARPS * GQ * D)
    return max(dynamic, 48004) if dynamic + static_bytes(G, GU, D, GQ, L) > 48 * 1024 else dynamic


def static_bytes(G, GU, D, GQ, L):
    """The body's static shared arrays."""
    return (4 * 8 * (G + GU) + 2 * 4 * BMAX + 4 * (BMAX + 1) + 8 * len(step.ARRAYS) * L
            + 4 * GQ * (D + 2 * WARPS))


@lru_cache(maxsize=None)
def rows_kernel(layers):
    return make_kernel("fn_decode_rows", step.input_names(layers), ["y", "p", "ys", "work"],
                       *source(layers))


def decode_rows(x, positions, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps, n_heads,
                n_kv_heads, group_size, bits, norm="flash", windows=None, gelu=False):
    """step.decode_layers for B rows (x: (B, 1, K), positions: (B,) int32, caches (B, kv heads,
    capacity, D) per layer; norm, windows, gelu as there): one launch where step.supported says
    it runs and its plan fits the GPU, else the reference."""
    # I, HQ and HKV: the widest layer's
    K, D, I, _, HQ, HKV, _ = step.sizes(x, layers, theta, n_heads, n_kv_heads)
    plan = (step.supported(x, layers, caches, n_heads, n_kv_heads, group_size, bits,
                           name="decode_rows")
            and launch_plan(x.shape[0], K, I, D, HQ, HKV, len(layers)))
    if not plan:
        return reference(x, positions, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps,
                         n_heads, n_kv_heads, group_size, bits, norm=norm, windows=windows,
                         gelu=gelu)
    template, work, shared = plan
    return step.launch(rows_kernel(len(layers)), x, positions.astype(mx.int32), layers, caches,
                       gains, qk_gains, theta, eps, factor, qk_eps, n_heads, n_kv_heads,
                       group_size, bits, work=work, shared_memory=shared, fields=SIZES,
                       template=template, norm=norm, windows=windows, gelu=gelu)


def prefill_rows(x, start, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps, n_heads,
                 n_kv_heads, group_size, bits, norm="flash", windows=None, gelu=False):
    """decode_rows over the n tokens of one sequence (x: (n, 1, K), at positions start .. start
    + n - 1; start an int or an int32 array of one) into its caches ((1, kv heads, capacity, D) per
    layer): each token attends to the positions up to its own, the tokens' before it included
    (every new k and v is written before any token attends). One launch where step.supported
    (name "prefill_rows") says it runs and its plan fits, else prefill_reference."""
    K, D, I, _, HQ, HKV, _ = step.sizes(x, layers, theta, n_heads, n_kv_heads)
    plan = (step.supported(x, layers, caches, n_heads, n_kv_heads, group_size, bits,
                           name="prefill_rows")
            and launch_plan(x.shape[0], K, I, D, HQ, HKV, len(layers)))
    args = (gains, qk_gains, theta, eps, factor, qk_eps, n_heads, n_kv_heads, group_size, bits)
    if not plan:
        return prefill_reference(x, start, layers, caches, *args, norm=norm, windows=windows,
                                 gelu=gelu)
    template, work, shared = plan
    positions = (step.position_array(start)[:1] + mx.arange(x.shape[0])).astype(mx.int32)
    return step.launch(rows_kernel(len(layers)), x, positions, layers, caches, *args, work=work,
                       shared_memory=shared, fields=SIZES, template=template, norm=norm,
                       windows=windows, gelu=gelu, prefill=True)


def prefill_reference(x, start, layers, caches, *args, **kwargs):
    """prefill_rows in plain MLX: step._reference token by token, each into the caches the one
    before it wrote."""
    outs = []
    for b in range(x.shape[0]):
        *out, caches = step._reference(x[b:b + 1], start + b, layers, caches, *args, **kwargs)
        outs.append(out)
    return (*(mx.concatenate([o[i] for o in outs]) for i in range(3)), caches)


def launch_plan(B, K, I, D, n_heads, n_kv_heads, L):
    """(template, work, shared) of a launch for B rows (I, n_heads, n_kv_heads: the widest layer's,
    step.sizes): its rows per pass (G, GD, IC: rows_per_pass; GU: gate_up_rows) within the shared
    memory the GPU gives a block (step.shared_limit), its work buffer's floats and its shared memory
    bytes; None where it cannot fit."""
    xa, GQ = max(K, n_heads * D), n_heads // n_kv_heads
    limit = min(SHARED_MAX, step.shared_limit() - static_bytes(GMAX, GMAX, D, GQ, L))
    if (plan := rows_per_pass(B, xa, I, limit)) is None:
        return None
    G, GD, IC = plan
    GU = gate_up_rows(B, G, GD, xa, IC, limit)
    shared = shared_bytes(G, GD, GU, xa, IC, D, GQ, L)
    if shared + static_bytes(G, GU, D, GQ, L) > step.shared_limit():
        return None
    floats = B * ((n_heads + 2 * n_kv_heads) * D + n_heads * step.SMAX * (D + 2) + 3)
    # the T rows after the floats, as if of 4 bytes
    work = -(-floats // 4) * 4 + B * (2 * K + n_heads * D + I)
    # XA in the template, not read at run time: two launches of one binary (MLX loads it once, by
    # its bytes, and fixes its dynamic shared limit at the first) ask the same shared bytes
    return ([("XA", xa), ("G", G), ("GD", GD), ("GU", GU), ("IC", IC), ("NW", WARPS)], work,
            shared)


def reference(x, positions, layers, caches, *args, **kwargs):
    """decode_rows in plain MLX: step._reference row by row (its caches' row b at positions[b])."""
    outs = [step._reference(x[b:b + 1], positions[b], layers,
                            [(k[b:b + 1], v[b:b + 1]) for k, v in caches], *args, **kwargs)
            for b in range(x.shape[0])]
    y, ys, p = (mx.concatenate([o[i] for o in outs]) for i in range(3))
    kv = [tuple(mx.concatenate([o[3][l][j] for o in outs]) for j in range(2))
          for l in range(len(layers))]
    return y, ys, p, kv


def _checked(run, rows, x, written):
    """The outputs of run(x, layers, caches, *args) over the one-row check's stacks
    (stacks.check_stacks: layers alike, of their own sizes, with q/k/v biases, full precision,
    Gemma 3's form) with caches of `rows` rows filled up to 41 positions, each in its modes, and
    the cache entries it wrote (written(a): those of a cache array a)."""
    out = []
    for layers, caches, HQ, HKV, bits, theta, form, modes in stacks.check_stacks(rows, 41, 40):
        for gains, qk_gains, factor, qk_eps, norm in modes:
            kv = [tuple(mx.array(a) + 0 for a in c) for c in caches]
            y, ys, p, kv = run(x, layers, kv, gains, qk_gains, theta, 1e-5, factor, qk_eps, HQ,
                               HKV, 64, bits, norm=norm, **form)
            out += [y, ys, p] + [written(a) for c in kv for a in c]
    return out


def check_decode_rows():
    """Three rows at positions 40, 5 and 17, a cache row each."""
    positions = mx.array([40, 5, 17], mx.int32)
    return _checked(lambda x, *a, **k: decode_rows(x, positions, *a, **k), 3, rand((3, 1, 256), 44),
                    lambda a: mx.take_along_axis(a, positions.reshape(3, 1, 1, 1), axis=2))


def check_prefill_rows():
    """18 tokens of one sequence after 20 cached positions (two passes of the matvecs' rows)."""
    start, n = 20, 18
    return _checked(lambda x, *a, **k: prefill_rows(x, start, *a, **k), 1, rand((n, 1, 256), 45),
                    lambda a: a[:, :, start:start + n])


CHECK = (check_decode_rows, 2e-2)
PREFILL_CHECK = (check_prefill_rows, 2e-2)
