"""decode_chunk: several greedy decode steps of one row in one CUDA launch.

Batch-1 decoding with the whole-step kernel (decode_layers) waits on the host: queueing a step
costs it far more than the kernel's weights take to read (bench/RESULTS.md, "Serving"). Here one
persistent launch runs `steps` of them (at most k), each decode_layers' layers (step.cu's body,
composed, not copied: its STEPS_OPEN and STEPS_CLOSE lines take cuda/chunk.cu's loop), then, between
grid barriers, the final norm in the stack's norm mode, the LM head's matvec over the vocabulary, a
grid-wide argmax (the lowest id of the largest logit, as mx.argmax) and that token's embedding row,
dequantized, as the next step's input. The tokens come back as one array; the host streams them
(decoding's chunked.py). Greedy only: a sampled, penalized or constrained token needs the host
between steps.

The final norm and head as the model's modules compute and round them: flash, p = y * ys + r in T
and s = 1/RSSe(p) (the final DeferredNorm's add_rss), the head's input p * g * P in T (g: the norm's
gain, where kept; P: s's power of two in half precision) and its output rounded to T, then times
s / P rounded again (TiedFlashHead, FlashHead); rms, RMSNorm(y + r) with the final norm's weights,
rounded as the layers' (fn_normed); none, y + r; the head's output rounded to T. The embedding and
the head: affine 4- or 8-bit (a tied head is the embedding's arrays). Its plain-MLX reference
(reference: k steps of decode_layers' reference, the final norm, head and argmax) is the fallback
and the self-check's yardstick (CHECK)."""
from functools import lru_cache

import mlx.core as mx

from .build import constant, declare, fill, make_kernel, pack, pieces, position_array, rand
from .scale import power_of_two_below
from . import step

K_MIN = 4  # tokens come back in 16 bytes at least (MLX keeps 8 bytes or less in a managed page)
# the chunk's own sizes and flags (cdims, in order: build.pack, build.declare): the head's rows, the
# embedding's and the head's group size and bits, whether the final norm has gains (hg: flash's
# gain, rms's weights) and its epsilon, and where its scratch begins in the work buffer (after
# decode_layers': step.work_size)
FIELDS = (("V", "int"), ("EGS", "int"), ("EBITS", "int"), ("HGS", "int"), ("HBITS", "int"),
          ("has_hg", "bool"), ("heps", "float"), ("WORK", "int"))
# the inputs before decode_layers' (which the chunk takes but for its input row x, made here):
# the first step's token, the steps to run, cdims, the embedding's and the head's arrays, hg
OWN = ["prev", "steps", "cdims", "ew", "es", "eb", "hw", "hsc", "hbi", "hg"]


def input_names(layers):
    """The kernel's inputs: OWN, then decode_layers' but its input row (made on the device: erow
    in chunk.cu; the launcher drops it from step.launch's inputs)."""
    shared = step.input_names(layers)
    assert shared[0] == "x"
    return OWN + shared[1:]


def source(layers):
    """decode_chunk's CUDA for `layers` layers, (body, header) as make_kernel takes them: step.cu's
    body with chunk.cu's open and close pieces on its STEPS_OPEN and STEPS_CLOSE lines, chunk.cu's
    device functions after step.cu's header."""
    mine = pieces(step.CUDA / "chunk.cu", "device", "open", "close")
    body, header = step.compose(step.CUDA, "step.cu", step.SIZES, layers,
                                STEPS_OPEN=fill(mine["open"], FIELDS=declare(FIELDS, "cdims")),
                                STEPS_CLOSE=mine["close"])
    return body, header + mine["device"]


@lru_cache(maxsize=None)
def chunk_kernel(layers):
    return make_kernel("fn_decode_chunk", input_names(layers), ["y", "p", "ys", "work", "tokens"],
                       *source(layers))


def shared_bytes(K, xmax, bits, D, GQ, L, total=False):
    """decode_layers' shared memory (step.shared_bytes) with chunk.cu's: its chunk sums sized for
    8-bit chunks (the head's may be 8-bit where the layers' are 4), the step's input row (K floats)
    and the argmax's per-warp values (NW floats and ints, and the token)."""
    asked = step.shared_bytes(K, xmax, bits, D, GQ, L)
    static = step.shared_bytes(K, xmax, bits, D, GQ, L, True) - asked + 4 * (2 * 8 + 1)
    dynamic = 4 * (2 * K + xmax + xmax // 16)
    asked = max(dynamic, 48004) if dynamic + static > 48 * 1024 else dynamic
    return asked + static if total else asked


def _row(K, dtype):
    """A stand-in for decode_layers' input row (its shape and dtype; never evaluated)."""
    return mx.zeros((1, 1, K), dtype)


def supported(layers, caches, n_heads, n_kv_heads, group_size, bits, embedding, head, head_gain,
              norm, k):
    """Whether the kernel takes this stack: decode_layers does (step.supported: CUDA, our kernels
    on, decode_layers not disabled), decode_chunk is not disabled either, the embedding and head
    (w, scales, biases, group size, bits each) affine 4- or 8-bit of the stack's width and dtype,
    the head's groups whole 16-byte chunks, as many embedding rows as head rows at least (a token
    indexes both), hg where the mode has one (rms: the final norm's weights; flash: its gain or
    None; none: None), and the chunk's shared memory within the GPU's."""
    (ew, es, eb, egs, ebits), (hw, hs, hb, hgs, hbits) = embedding, head
    T, K = es.dtype, ew.shape[-1] * 32 // ebits if ebits in (4, 8) else 0
    if not (K and step.use_decode_layers("decode_chunk") and 1 <= k
            and step.supported(_row(K, T), layers, caches, n_heads, n_kv_heads, group_size, bits)):
        return False
    V = hw.shape[0]
    if not (hbits in (4, 8) and ew.ndim == hw.ndim == 2 and ew.dtype == hw.dtype == mx.uint32
            and hw.shape[1] * 32 // hbits == K and K % egs == 0 and K % hgs == 0
            and hgs % (4 * 32 // hbits) == 0 and 0 < V <= ew.shape[0] < 2**31
            and es.shape == eb.shape == (ew.shape[0], K // egs)
            and hs.shape == hb.shape == (V, K // hgs)
            and all(a.dtype == T for a in (es, eb, hs, hb))
            and (head_gain is None if norm == "none" else norm == "flash" or head_gain is not None)
            and (head_gain is None or head_gain.shape == (K,) and head_gain.dtype == mx.float32)):
        return False
    per = step.layer_sizes(layers, n_heads, n_kv_heads)
    D, HQ, I = caches[0][0].shape[-1], max(q for q, _, _ in per), max(i for _, _, i in per)
    return (shared_bytes(K, max(K, HQ * D, I), bits, D, per[0][0] // per[0][1], len(layers), True)
            <= step.shared_limit())


def decode_chunk(prev, offset, steps, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps,
                 n_heads, n_kv_heads, group_size, bits, embedding, head, head_gain, head_eps, k,
                 norm="flash"):
    """`steps` greedy decode steps (an int32 array, its first value from 1 to k) of one row of a
    Llama-family stack, after the token prev ((1,) uint32) at position offset (an int or the decode
    step's array): (tokens, caches), tokens (max(k, K_MIN),) uint32 whose first `steps` are the
    steps' tokens, caches the (k, v) buffers with the steps' positions written. The stack's
    arguments as decode_layers takes them (norm: its mode); embedding, head: (weight, scales,
    biases, group size, bits) of the quantized embedding and LM head (tied: the embedding's);
    head_gain, head_eps: the final norm's gains (flash: its DeferredNorm's gain or None; rms: its
    weights, float32; none: None) and epsilon."""
    if not supported(layers, caches, n_heads, n_kv_heads, group_size, bits, embedding, head,
                     head_gain, norm, k):
        return reference(prev, offset, steps, layers, caches, gains, qk_gains, theta, eps, factor,
                         qk_eps, n_heads, n_kv_heads, group_size, bits, embedding, head, head_gain,
                         head_eps, k, norm)
    (ew, es, eb, egs, ebits), (hw, hs, hb, hgs, hbits) = embedding, head
    x = _row(ew.shape[-1] * 32 // ebits, es.dtype)
    K, D, I, xmax, HQ, HKV, GQ = step.sizes(x, layers, theta, n_heads, n_kv_heads)
    work = step.work_size(K, D, I, HQ, HKV)
    dims = pack(FIELDS, dict(V=hw.shape[0], EGS=egs, EBITS=ebits, HGS=hgs, HBITS=hbits,
                             has_hg=head_gain is not None, heps=head_eps, WORK=work))
    own = [prev.reshape(-1), position_array(steps), constant(mx.int32, *dims), ew, es, eb, hw, hs,
           hb, constant(mx.float32, 0.0) if head_gain is None else head_gain]
    out = []

    def kernel(*, inputs, output_shapes, output_dtypes, **launch):
        # decode_layers' launch (step.launch) with this kernel's inputs in place of its input row,
        # and the tokens as a fifth output
        *four, tokens = chunk_kernel(len(layers))(
            inputs=own + inputs[1:], output_shapes=[*output_shapes, (max(k, K_MIN),)],
            output_dtypes=[*output_dtypes, mx.uint32], **launch)
        out.append(tokens)
        return four

    # the work buffer: decode_layers', then each block's largest logit and its token
    caches = step.launch(kernel, x, position_array(offset), layers, caches, gains, qk_gains, theta,
                         eps, factor, qk_eps, n_heads, n_kv_heads, group_size, bits,
                         work=work + 2 * step.sm_count(),
                         shared_memory=shared_bytes(K, xmax, bits, D, GQ, len(layers)),
                         norm=norm)[3]
    return out[0], caches


def reference(prev, offset, steps, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps,
              n_heads, n_kv_heads, group_size, bits, embedding, head, head_gain, head_eps, k,
              norm="flash", logits=None):
    """decode_chunk in plain MLX: k steps, each the token's embedding row (mx.dequantize, as the
    model's embedding), decode_layers' reference (step._reference), the final norm and the head as
    the kernel rounds them and mx.argmax; a step past `steps` leaves the caches as they were. The
    fallback and the self-check's yardstick; logits: a list that takes each step's logits (the
    tests read the self-check's margins)."""
    (ew, es, eb, egs, ebits), (hw, hs, hb, hgs, hbits) = embedding, head
    f32, T = mx.float32, es.dtype
    rnd = lambda v: v.astype(T).astype(f32)
    pos = position_array(offset)[:1].reshape(())
    count = position_array(steps)[:1].reshape(())
    token, tokens = prev.reshape(-1)[:1], []
    for i in range(k):
        x = mx.dequantize(ew[token], es[token], eb[token], group_size=egs, bits=ebits)[None]
        y, ys, p, written = step._reference(x, pos + i, layers, caches, gains, qk_gains, theta,
                                            eps, factor, qk_eps, n_heads, n_kv_heads, group_size,
                                            bits, norm)
        caches = [tuple(mx.where(i < count, a, b) for a, b in zip(w, c))
                  for w, c in zip(written, caches)]
        h = rnd(y.astype(f32) * ys + p.astype(f32)).reshape(1, -1)  # ys: 1 in rms and none
        if norm == "flash":
            s = mx.rsqrt((h * h).sum() + h.shape[-1] * head_eps)
            P = power_of_two_below(s) if T != f32 else mx.array(1.0)
            xg = rnd(h * (1.0 if head_gain is None else head_gain) * P)
            out = rnd(rnd(step._qmm(xg, hw, hs, hb, hgs, hbits)) * (s / P))
        else:
            if norm == "rms":  # RMSNorm as the layers' (step._reference) rounds it
                h = rnd(rnd(h * mx.rsqrt((h * h).mean(-1, keepdims=True) + head_eps))
                        * head_gain)
            out = rnd(step._qmm(h, hw, hs, hb, hgs, hbits))
        token = mx.argmax(out.reshape(-1)).astype(mx.uint32).reshape(1)
        tokens.append(token)
        if logits is not None:
            logits.append(out.reshape(-1))
    return mx.concatenate(tokens + [token] * (max(k, K_MIN) - k)), caches


def check_decode_chunk(run=None, modes=slice(None, None, 2)):
    """Four steps after position 40 on the self-check's stack of two layers of their own sizes
    (step.check_stacks), in each norm mode (modes: of step.check_modes, those without QK-norm,
    which decode_layers' check covers: two compiled variants, not three) with the final norm's
    gains of its kind; a tied head (the 8-bit embedding, groups of 32) and an untied one (4-bit,
    groups of 64) in turn: the tokens and the cache rows written. Its seeds give each argmax a
    margin far past half precision's rounding (tests/test_chunk.py reads them from the
    reference's logits). run: decode_chunk, or the reference with its logits."""
    run = run or decode_chunk
    L, K, D, V, pos, k = 2, 256, 64, 96, 40, 4
    layers, caches, HQ, HKV, theta, _ = step.check_stacks(1, pos, 40)[1]
    # an embedding small beside the layers' outputs (else a tied head picks the input token again)
    embedding = (*mx.quantize(rand((V, K), 50, scale=0.1), 32, 8), 32, 8)
    untied = (*mx.quantize(rand((V, K), 55, scale=0.05), 64, 4), 64, 4)
    gain = 16 * (1 + 0.3 * rand((K,), 48, mx.float32))
    weight = (1 + 0.3 * rand((K,), 49, mx.float32)).astype(mx.float16).astype(mx.float32)
    out = []
    for i, (gains, qk, factor, qk_eps, norm) in enumerate(step.check_modes(L, K, D)[modes]):
        kv = [tuple(mx.array(a) for a in c) for c in caches]
        tokens, kv = run(mx.array([3 + 7 * i], mx.uint32), pos, constant(mx.int32, k), layers, kv,
                         gains, qk, theta, 1e-5, factor, qk_eps, HQ, HKV, 64, 4, embedding,
                         untied if i % 2 else embedding,
                         {"flash": gain, "rms": weight, "none": None}[norm], 1e-5, k, norm=norm)
        out += [tokens[:k]] + [a[..., pos:pos + k, :] for c in kv for a in c]
    return out


CHECK = (check_decode_chunk, 2e-2)
