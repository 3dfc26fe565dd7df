"""The compiled decode step (StaticKVCache, mx.compile) against the plain forward pass, for every
architecture in models/ with norm rms and flash."""
import collections
import io

import mlx.core as mx
import pytest

from mlx_flashnorm import kernels
from mlx_flashnorm.kernels import build, nvrtc
from mlx_flashnorm.bench.step_graph import step_ops
from mlx_flashnorm import cache as cache_module
from mlx_flashnorm.cache import make_cache
from mlx_flashnorm.decoding import (StaticKVCache, decode_offset, generate_step, make_sampler_for, position,
                                    warmup)
from mlx_flashnorm.loader import build_model, model_args, prepare

from conftest import (GEMMA3, QWEN2, QWEN3, TINY_LLAMA, TINY_OPENELM, count_traces, f32_tol, random_model,
                      random_weights)

CONFIGS = {"llama": TINY_LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "openelm": TINY_OPENELM,
           "gemma3": dict(GEMMA3, sliding_window=32)}  # 6 of its 7 layers: a window of 32 positions
# A cache of 2048 positions (cache_capacity of 1040), which the CUDA decode attention splits over
# blocks of kernels.CHUNK positions (above kernels.SPLIT_ABOVE); mlx-lm's KVCache grows every 256
# positions: 30 steps cross the boundary at 1024 by 16.
PROMPT = 1010
STEPS = 30
PREFILL_STEP = 256  # the prompt is prefilled in 4 chunks
SHORT = 250  # a prompt whose request fits the first cache bucket (1024 positions)
RTOL = 1e-4  # float32; the compiled graph fuses element-wise ops, so sums may round differently


@pytest.fixture(scope="module", params=[(a, n) for a in CONFIGS for n in ("rms", "flash")],
                ids=lambda p: "-".join(p))
def model(request):
    name, norm = request.param
    return random_model(dict(CONFIGS[name], max_position_embeddings=2048, max_context_length=2048), norm)


def run(model, compiled, sampler=None, length=PROMPT):
    prompt = mx.random.randint(0, model.args.vocab_size, (length,), key=mx.random.key(7))
    out = list(generate_step(prompt, model, sampler=sampler, max_tokens=STEPS, compiled=compiled,
                             prefill_step=PREFILL_STEP))
    return [t for t, _ in out], mx.stack([lp for _, lp in out])


def test_compiled_decode_matches_eager(model):
    eager_tokens, eager_lp = run(model, compiled=False)
    tokens, lp = run(model, compiled=True)
    assert tokens == eager_tokens
    assert len(set(tokens)) > STEPS // 2  # a real sequence, not one token repeated
    assert mx.allclose(lp, eager_lp, rtol=f32_tol(RTOL), atol=f32_tol(RTOL)).item()


def test_step_writes_its_cache_by_scatter(model):
    """One scatter along the positions per buffer and layer: MLX 0.32's CUDA dynamic slice
    update copies the whole buffer (bench/RESULTS.md, "GPU time per kernel")."""
    ops = collections.Counter(step_ops(model))
    assert ops["DynamicSliceUpdate"] == 0 and ops["ScatterAxis"] == 2 * len(model.layers)


def test_step_reads_sixteen_byte_arrays():
    """The decode offset and the kernels' constants are 16 bytes, and the position is a view of
    the offset's buffer: MLX's CUDA backend keeps arrays of 8 bytes or less in a managed page."""
    offset = decode_offset(1234)
    assert offset.nbytes == 16 and position(offset).item() == 1234 and position(offset).shape == ()
    assert "Gather" not in step_graph_of(position(offset) + 0)
    assert kernels.constant(mx.float32, 0.125).nbytes == kernels.constant(mx.int32, 3, 1, 2).nbytes == 16
    assert kernels.constant(mx.int32, *range(6)).tolist() == list(range(6))


def test_step_attends_from_the_offset_view(monkeypatch):
    """The decode attention gets the step's position view itself, not the count after the write
    (offset + 1, a computed 4-byte array in MLX's managed small-array pool)."""
    seen = []
    monkeypatch.setattr(cache_module, "decode_attention", lambda q, k, v, start, scale: seen.append(start) or q)
    c = StaticKVCache(8)
    c.update_and_fetch(mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))
    at = position(decode_offset(3))
    c.offset = at
    c.attention(mx.zeros((1, 2, 1, 4)), *c.update_and_fetch(mx.ones((1, 2, 1, 4)), mx.ones((1, 2, 1, 4))), 0.5, None)
    assert len(seen) == 1 and seen[0] is at


@pytest.mark.skipif(not mx.cuda.is_available(), reason="MLX's CUDA allocator")
@pytest.mark.parametrize("norm", ["rms", "flash"])
def test_step_kernels_make_no_tiny_arrays(norm, monkeypatch):
    """Every custom kernel output of a float16, 4-bit decode step is 16 bytes or more: a kernel
    reading an array of 8 bytes or less waits on MLX's managed small-array pool (kernels.constant)."""
    config = dict(TINY_LLAMA, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)  # head dim 64
    arch, args = model_args(config)
    model = build_model(config, random_weights(arch.Model(args), seed=1), progress=False)
    model.set_dtype(mx.float16)
    model = prepare(model, norm=norm, bits=4, group_size=32)
    kernels.self_check()  # before recording: the checks' own inputs are not a step's
    made = {}
    launch = mx.fast.precompiled_cuda_kernel

    def recording(**kw):
        out = launch(**kw)
        made.setdefault(kw["name"], []).extend(out)
        return out

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", recording)
    step_ops(model)
    # rms: the per-sublayer kernels; flash: the whole step in one (kernels.decode_layers)
    assert "fn_decode_attention" in made if norm == "rms" else "fn_decode_layers" in made
    assert {name: min(a.nbytes for a in out) for name, out in made.items() if min(a.nbytes for a in out) < 16} == {}


def step_graph_of(a):
    f = io.StringIO()
    mx.export_to_dot(f, a)
    return f.getvalue()


def test_compiled_decode_samples_like_eager(model):
    sampler = make_sampler_for(temp=1.0, top_k=20)
    mx.random.seed(3)
    eager_tokens, _ = run(model, compiled=False, sampler=sampler, length=SHORT)
    mx.random.seed(3)
    tokens, lp = run(model, compiled=True, sampler=sampler, length=SHORT)
    assert tokens == eager_tokens
    greedy, _ = run(model, compiled=True, length=SHORT)
    assert tokens != greedy  # it did sample
    top20 = mx.argsort(-lp, axis=-1)[:, :20]
    for t, keep in zip(tokens, top20.tolist()):  # each token is drawn from its own step's top 20
        assert t in keep


def test_static_cache_refuses_overflow():
    cache = StaticKVCache(4)
    kv = mx.zeros((1, 2, 3, 8))
    cache.update_and_fetch(kv, kv)
    with pytest.raises(ValueError, match="4 positions"):
        cache.update_and_fetch(kv, kv)


def test_kept_cache_continues_like_one_prompt(model):
    """A cache kept across generate_step calls (a chat's turns): each call prefills only its own
    tokens and decodes exactly as if everything so far had been one prompt."""
    # prompts whose greedy picks are decisive (top-2 log-probability gap > 1e-2 for every model
    # here): with a second prompt of 30 tokens Qwen 3's gap was 2e-5, which TF32 flips on a GPU
    a, b = (mx.random.randint(0, model.args.vocab_size, (n,), key=mx.random.key(n)) for n in (60, 31))
    cache = make_cache(model, 200)
    first = [t for t, _ in generate_step(a, model, max_tokens=5, cache=cache)]
    assert cache[0].offset == 60 + 4  # the last token yielded was never fed
    steps = generate_step(b, model, max_tokens=STEPS, cache=cache)
    second = [next(steps)[0], next(steps)[0]]
    steps.close()  # stopped early: the cache still holds what was fed
    assert cache[0].offset == 64 + 31 + 2
    held = mx.concatenate([a, mx.array(first[:4]), b, mx.array(second)])
    third = [t for t, _ in generate_step(b[:10], model, max_tokens=STEPS, cache=cache)]
    whole = [t for t, _ in generate_step(mx.concatenate([held, b[:10]]), model, max_tokens=STEPS)]
    assert third == whole
    assert [t for t, _ in generate_step(mx.concatenate([a, mx.array(first[:4]), b]), model,
                                        max_tokens=2)] == second


def test_requests_reuse_one_compiled_step(model, monkeypatch):
    """Issue 15: the compiled step is traced once per model and cache bucket, not per request;
    requests of other prompt lengths and max_tokens add no trace, and give the eager path's tokens
    (a one-token prompt included: its token runs eagerly, allocating the cache)."""
    traces = count_traces(model, monkeypatch)
    model._compiled_decode = None  # as loaded: no step yet
    for n, (length, steps) in enumerate([(5, 7), (1, 4), (37, 3), (120, 12), (9, 30)]):
        prompt = mx.random.randint(0, model.args.vocab_size, (length,), key=mx.random.key(n))
        tokens = [t for t, _ in generate_step(prompt, model, max_tokens=steps)]
        assert tokens == [t for t, _ in generate_step(prompt, model, max_tokens=steps, compiled=False)]
        assert len(traces) == 1, (length, steps, traces)


def test_warmup_traces_the_step_and_changes_no_token(model, monkeypatch):
    """After generate.warmup the first request of the first cache bucket traces nothing, and its
    tokens and log-probabilities are those of a first request without a warm-up."""
    traces = count_traces(model, monkeypatch)
    model._compiled_decode = None
    cold_tokens, cold_lp = run(model, compiled=True, length=SHORT)
    model._compiled_decode = None
    warmup(model)
    assert len(traces) == 2
    tokens, lp = run(model, compiled=True, length=SHORT)
    assert len(traces) == 2
    assert tokens == cold_tokens and mx.array_equal(lp, cold_lp).item()


@pytest.mark.skipif(not (mx.cuda.is_available() and mx.default_device() == mx.gpu),
                    reason="the custom kernels run on CUDA only")
def test_requests_compile_no_new_kernels(model):
    """Sizes (prompt length, cache capacity) reach the kernels at run time, not as template
    constants: after a first request, others of new lengths launch no new kernel variant and
    compile no new binary (nvrtc.cuda_binary: one per distinct CUDA file)."""
    for n, (length, steps) in enumerate([(6, 4), (41, 9), (300, 5)]):
        prompt = mx.random.randint(0, model.args.vocab_size, (length,), key=mx.random.key(n))
        list(generate_step(prompt, model, max_tokens=steps))
        if n == 0:
            first, binaries = set(build.VARIANTS), nvrtc.cuda_binary.cache_info().currsize
        assert build.VARIANTS == first
        assert nvrtc.cuda_binary.cache_info().currsize == binaries


def test_changed_model_gets_a_new_step(model):
    """compiled_decode keeps one step per model while the model is unchanged (each link of its
    tree checked by identity, no walk of its parameters per request) and makes a new one when a
    module is swapped, a child added or a weight replaced, even by an equal array."""
    from mlx_flashnorm.decoding import compiled_decode

    model._compiled_decode = None
    step = compiled_decode(model)
    assert compiled_decode(model) is step
    first = model.layers[0]
    changes = [(lambda: model.layers.__setitem__(0, model.layers[1]), lambda: model.layers.__setitem__(0, first)),
               (lambda: setattr(first, "extra", mx.zeros((1,))), lambda: first.pop("extra"))]
    for change, undo in changes:
        change()
        assert compiled_decode(model) is not step
        undo()
        step = compiled_decode(model)
        assert compiled_decode(model) is step
    norm = next(m for _, m in model.named_modules() if "weight" in m)
    norm.weight = norm.weight + 0
    assert compiled_decode(model) is not step


def test_a_flash_model_loaded_on_one_thread_decodes_on_another(tiny_llama_dir):
    """FlashNorm's RoPE angles are no parameters: they are evaluated at load, so a worker thread
    (the server's one-request worker) can run a model loaded on the main thread (it raised 'There is
    no Stream(cpu, 0) in current thread')."""
    import threading

    from mlx_flashnorm import generate, load

    model, tok = load(tiny_llama_dir, norm="flash", progress=False)
    out = []
    worker = threading.Thread(target=lambda: out.append(generate(model, tok, "hi", max_tokens=3, chat_template=False)))
    worker.start()
    worker.join()
    assert out == [generate(model, tok, "hi", max_tokens=3, chat_template=False)]
