"""decoding.prefill's compiled form (issue 61) against the eager forward pass: prompt tokens padded
to a bucket of lengths (PREFILL_BUCKETS) through one mx.compile'd forward pass leave the same cache,
the padding changing no result. Every architecture in float32, float16 and bfloat16, into an empty
cache and after a prefix, into a StaticKVCache (generate_step's) and mlx-lm's KVCache (the
engine's); the real SmolLM2. On the CPU a prefill runs eagerly unless told
(forms.compiled_prefill): these tests pass compiled=True, or switch it on."""
import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlx_flashnorm import decoding, forms, kernels, load
from mlx_flashnorm.cache import make_cache
from mlx_flashnorm.flashnorm import kv_buffers
from mlx_flashnorm.decoding import PREFILL_BUCKETS, cache_capacity, generate_step, prefill
from mlx_flashnorm.serve.engine import BatchEngine
from mlx_flashnorm.serve.prompt_cache import PromptCache
from mlx_flashnorm.serve.sequence import Request

from conftest import GEMMA3, QWEN3, TINY_LLAMA, TINY_OPENELM, f32_tol, random_model

CONFIGS = {"llama": TINY_LLAMA, "qwen3": QWEN3, "gemma3": GEMMA3, "openelm": TINY_OPENELM}
# max |compiled - eager| / max |eager| of the cache and of the next token's logits: the padded rows
# leave the real ones' arithmetic as it was (the CPU: equal), but a GPU's matmul may tile a padded
# height otherwise; padding seen by a real position would move them by a whole attention's share
TOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}
FIRST, SECOND = 11, 20  # two chunks: buckets of 16 into an empty cache, of 32 after the first's
STEPS = 6


@pytest.fixture(scope="module", params=[(a, d) for a in CONFIGS for d in TOL],
                ids=lambda p: "-".join(p))
def model(request):
    name, dtype = request.param
    model = random_model(dict(CONFIGS[name], max_position_embeddings=256), "flash")
    model.set_dtype(getattr(mx, dtype))
    model.tol = f32_tol(TOL[dtype])  # (a plain attribute: no parameter)
    return model


def rel(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


def worst(kv, want):
    """The largest rel over the layers' keys and values."""
    return max(rel(a, b) for pair, wanted in zip(kv, want) for a, b in zip(pair, wanted))


def filled(model, tokens, cache, compiled, chunks=(FIRST, SECOND)):
    """tokens prefilled in chunks, then the last one's logits (eager); (logits, [(k, v)] of the
    positions written, the cache)."""
    at = 0
    for n in chunks:
        prefill(model, tokens[at:at + n], cache, compiled)
        at += n
    assert cache[0].offset == at
    logits = model(tokens[None, at:at + 1], cache=cache)[0, -1]
    kv = [(c.keys[..., :at + 1, :], c.values[..., :at + 1, :]) for c in cache]
    return logits, kv, cache


@pytest.mark.parametrize("kind", ["static", "kvcache"])
def test_compiled_prefill_leaves_the_eager_cache(model, kind):
    tokens = mx.random.randint(0, model.args.vocab_size, (FIRST + SECOND + 1,),
                               key=mx.random.key(3))
    capacity = 64 if kind == "static" else None
    want, want_kv, _ = filled(model, tokens, make_cache(model, capacity), False)
    got, kv, cache = filled(model, tokens, make_cache(model, capacity), True)
    assert rel(got, want) <= model.tol
    assert mx.argmax(got).item() == mx.argmax(want).item()
    assert worst(kv, want_kv) <= model.tol
    if kind == "kvcache":  # handed back as buffers of cache_capacity positions
        assert isinstance(cache[0], KVCache) and cache[0].offset == FIRST + SECOND + 1
        assert cache[0].keys.shape[2] == cache_capacity(model, FIRST + 32)


def test_greedy_tokens_equal_the_eager_prefill(model, monkeypatch):
    """generate_step (the compiled decode step) after the compiled prefill (in chunks of 12: buckets
    of 16, after a prefix but for the first) gives the greedy tokens and, within TOL, the
    log-probabilities it gives after the eager prefill."""
    tokens = mx.random.randint(0, model.args.vocab_size, (40,), key=mx.random.key(5))
    runs = []
    for on in (False, True):
        monkeypatch.setattr(forms, "compiled_prefill", lambda on=on: on)
        runs.append(list(generate_step(tokens, model, max_tokens=STEPS, compiled=True,
                                       prefill_step=12)))
    want, got = runs
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(rel(a, b) for (_, a), (_, b) in zip(got, want)) <= model.tol


def traced(monkeypatch, model):
    """A list that grows by (prompt bucket, kind) each time prefill's forward pass is traced."""
    calls, fill = [], decoding._fill

    def counting(model, ids, offset, kv, capacity):
        calls.append((ids.shape[0], "after a prefix" if kv else "empty"))
        return fill(model, ids, offset, kv, capacity)

    monkeypatch.setattr(decoding, "_fill", counting)
    # (where prefill_rows runs, a first prompt's buffers come with it: test_first_prompt_buffers...)
    monkeypatch.setattr(kernels, "use_decode_layers", lambda name="decode_layers": False)
    model._compiled_prefill = None
    return calls


def test_one_trace_per_bucket(monkeypatch):
    model = random_model(dict(TINY_LLAMA, max_position_embeddings=256), "flash")
    calls = traced(monkeypatch, model)
    for n in (5, 16, 9, 17, 30):
        prefill(model, list(range(n)), make_cache(model, 256), True)
    assert calls == [(16, "empty"), (32, "empty")]
    for n in (3, 12):
        cache = make_cache(model, 256)
        prefill(model, list(range(20)), cache, True)
        prefill(model, list(range(n)), cache, True)
    assert calls[2:] == [(16, "after a prefix")]
    assert PREFILL_BUCKETS[:5] == (16, 32, 64, 128, 256) and PREFILL_BUCKETS[-1] == 2048


@pytest.mark.parametrize("kind", ["static", "kvcache"])
def test_first_prompt_buffers_come_from_outside_the_trace(monkeypatch, kind):
    """Where prefill_rows runs, a first prompt's compiled prefill takes its cache buffers as inputs
    (kv_buffers: zeros of each layer's kv heads, OpenELM's differing, made before the trace):
    prefill_rows writes the caches in place, and buffers made inside a traced function may be
    merged into one by mx.compile (on an H200 every layer's k and v were one buffer). The caches
    are those of the eager prefill."""
    model = random_model(dict(TINY_OPENELM, max_position_embeddings=256), "flash")
    bufs = kv_buffers(model.layers, 64)
    assert [k.shape for k, _ in bufs] == [(1, 2, 64, 64), (1, 1, 64, 64)]
    assert all(a.dtype == mx.float32 and not a.any().item() for kv in bufs for a in kv)
    assert len({id(a) for kv in bufs for a in kv}) == 4
    given, fill = [], decoding._fill
    monkeypatch.setattr(decoding, "_fill", lambda model, ids, offset, kv, capacity: given.append(
        kv is not None and len(kv)) or fill(model, ids, offset, kv, capacity))
    monkeypatch.setattr(kernels, "use_decode_layers", lambda name="decode_layers": True)
    tokens = mx.random.randint(0, model.args.vocab_size, (FIRST + 1,), key=mx.random.key(4))
    capacity = 64 if kind == "static" else None
    got, kv, _ = filled(model, tokens, make_cache(model, capacity), True, (FIRST,))
    assert given == [2]
    want, want_kv, _ = filled(model, tokens, make_cache(model, capacity), False, (FIRST,))
    assert rel(got, want) <= TOL["float32"] and worst(kv, want_kv) <= TOL["float32"]


def test_a_bucket_past_the_cache_runs_eagerly(monkeypatch):
    """10 tokens after 30 would pad to 46 positions of a 41-position cache: eager, as it was."""
    model = random_model(dict(TINY_LLAMA, max_position_embeddings=256), "flash")
    calls = traced(monkeypatch, model)
    tokens = mx.random.randint(0, model.args.vocab_size, (41,), key=mx.random.key(9))
    want, _, _ = filled(model, tokens, make_cache(model, 41), False, (30, 10))
    got, _, _ = filled(model, tokens, make_cache(model, 41), True, (30, 10))
    assert calls == [(32, "empty")] and rel(got, want) <= TOL["float32"]


def test_engine_prefills_through_it(monkeypatch):
    """The batch engine's prefill (mlx-lm's KVCache, a prompt-cache prefix after the first
    request) through the compiled form: each request's greedy tokens are those it gets alone."""
    model = random_model(dict(GEMMA3, max_position_embeddings=256), "flash")
    head = mx.random.randint(0, 512, (14,), key=mx.random.key(1)).tolist()
    prompts = [head + mx.random.randint(0, 512, (n,), key=mx.random.key(n)).tolist()
               for n in (9, 21)]
    want = [[t for t, _ in generate_step(mx.array(p), model, max_tokens=STEPS, compiled=False)]
            for p in prompts]
    calls = traced(monkeypatch, model)
    monkeypatch.setattr(forms, "compiled_prefill", lambda: True)
    engine = BatchEngine(model, prompt_cache=PromptCache(1 << 24), feed=0)  # (feed: no prefill)
    got = []
    for p in prompts:  # one at a time: each prefilled alone at an idle engine
        request = Request(p, max_tokens=STEPS)
        engine.add(request)
        while engine.busy:
            engine.step()
        got.append(request.generated)
    assert got == want and calls == [(32, "empty"), (32, "after a prefix")]


@pytest.mark.parametrize("dtype, chunks", [("float32", (4, 7)), ("float16", (11,))])
def test_real_smollm2(dtype, chunks):
    """The embedded SmolLM2 (Q4_1, flash): 11 prompt tokens (float32: 7 after a 4-token prefix;
    buckets of 16): the cache and the next logits as the eager prefill's, the same greedy token."""
    model, tokenizer = load(None, dtype=dtype, progress=False)
    tokens = mx.array(tokenizer.encode("The capital of France is Paris. The capital of Italy is"))
    assert tokens.size == 12
    want, want_kv, _ = filled(model, tokens, make_cache(model, 64), False, chunks)
    got, kv, _ = filled(model, tokens, make_cache(model, 64), True, chunks)
    assert rel(got, want) <= f32_tol(TOL[dtype]) and worst(kv, want_kv) <= f32_tol(TOL[dtype])
    assert mx.argmax(got).item() == mx.argmax(want).item() == tokenizer.encode(" Rome")[0]
