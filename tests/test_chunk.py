"""Chunked greedy decoding (chunked.py) and its kernel (kernels.decode_chunk): on any device the
host side through the kernel's plain-MLX reference (the chunked path forced where the kernel does
not run) against one step at a time, in every architecture and norm mode it takes; on a CUDA GPU
the kernel against its reference and against one step at a time, on random shapes and the real
SmolLM2 weights, in half precision."""
import functools

import mlx.core as mx
import pytest

from mlx_flashnorm import chunked, forms, kernels, load
from mlx_flashnorm.bench import decode as decode_bench
from mlx_flashnorm.bench.cli import main as bench_main
from mlx_flashnorm.cache import make_cache
from mlx_flashnorm.decoding import (cache_capacity, compiled_decode, generate_step,
                                    make_processors, make_sampler_for, stream_generate)
from mlx_flashnorm.kernels import build, chunk, step
from mlx_flashnorm.loader import build_model, model_args, prepare

from conftest import GEMMA3, QWEN2, TINY_LLAMA, in_process, random_model, random_weights
from test_step_kernel import CONFIGS, CUDA, NONE_SCALE, tie_bound

STEPS = 4  # tokens a launch in these tests: 11 tokens are the first, then chunks of 4, 4 and 2
MODELS = dict(CONFIGS, **{"llama-untied": dict(CONFIGS["llama"], tie_word_embeddings=False)})


def quantized(config, norm, dtype=mx.float32):
    """A random 4-bit model of config (MODELS: test_step_kernel's shapes, the kernels'), in
    norm."""
    arch, args = model_args(config)
    weights = random_weights(arch.Model(args), seed=3, scale=NONE_SCALE if norm == "none" else 0.2)
    model = build_model(config, weights, progress=False)
    model.set_dtype(dtype)
    return prepare(model, norm=norm, bits=4, group_size=64)


@pytest.fixture
def queued(monkeypatch):
    """The list of each chunk's steps, as the host queues them."""
    queued, queue = [], chunked.Run._queue

    def counting(self, y, left):
        out = queue(self, y, left)
        if out is not None:
            queued.append(out[1])
        return out

    monkeypatch.setattr(chunked.Run, "_queue", counting)
    return queued


@pytest.fixture
def launches(monkeypatch, queued):
    """The chunked path taken where the kernel does not run (the CPU: chunked.Compiled.runs says
    yes for a model with a chunk form unless decode_chunk is disabled, and kernels.decode_chunk
    runs its reference), STEPS tokens a launch; the steps of each chunk queued (queued)."""
    runs = lambda self, kv: self.spec is not None and "decode_chunk" not in forms.DISABLED
    monkeypatch.setattr(chunked.Compiled, "runs", runs)
    monkeypatch.setattr(chunked, "STEPS", STEPS)
    return queued


def decode(model, prompt, max_tokens, cache=None, stop=None, **kwargs):
    """The tokens and log-probabilities generate_step yields, up to and with the token at index
    stop (the consumer stops there, as at a stop token), and the cache's offset after."""
    cache = cache or make_cache(model, cache_capacity(model, len(prompt) + max_tokens))
    out = []
    for token, lp in generate_step(mx.array(prompt), model, max_tokens=max_tokens, cache=cache,
                                   **kwargs):
        out.append((token, lp))
        if len(out) - 1 == stop:
            break
    return [t for t, _ in out], [lp for _, lp in out], cache


def prompt_of(model, n=40, seed=5):
    return mx.random.randint(0, model.args.vocab_size, (n,), key=mx.random.key(seed)).tolist()


@pytest.mark.parametrize("name,norm", [("llama", "flash"), ("llama-untied", "rms"),
                                       ("llama-untied", "none"), ("qwen3", "rms"),
                                       ("openelm", "flash")])
def test_chunks_decode_like_one_step_at_a_time(launches, name, norm):
    """The reference's chunks (k eager steps of the stack's reference, the final norm, the head and
    the argmax) give the model's own greedy tokens, one step at a time (Llama's Sec. 3 and its
    untied head, Qwen 3's and OpenELM's QK-norm, OpenELM's layers of their own sizes; flash, rms
    and none): 11 tokens, the first from the one-token step, then launches of 4, 4 and 2 (never
    past max_tokens), no log-probabilities; the cache keeps what it was fed, as one step at a
    time keeps it."""
    model = quantized(MODELS[name], norm)
    assert chunked.spec(model) is not None
    prompt = prompt_of(model)
    want, lps, want_cache = decode(model, prompt, 11)
    assert not launches and all(lp is not None for lp in lps)
    got, lps, cache = decode(model, prompt, 11, with_logprobs=False)
    assert launches == [4, 4, 2] and lps == [None] * 11
    assert got == want and len(set(want)) > 3  # a real sequence, not one token again
    assert cache[0].offset == want_cache[0].offset == len(prompt) + 10


def test_stop_inside_a_chunk_keeps_what_was_fed(launches):
    """A consumer that stops at a token inside a chunk (a stop token) gets the tokens up to it;
    the chunk after, queued before it was read, is dropped: the cache's offset is the tokens fed
    up to the stop, as one step at a time leaves it, and a next turn on that cache (whose
    positions past the offset hold the dropped steps' k and v) decodes as it does there.
    max_tokens of 1 and 2 launch no chunk and one of one step; a one-token prompt (its first
    token from the eager pass that makes the caches) goes on in chunks alike."""
    model = quantized(MODELS["llama"], "flash")
    prompt, turn = prompt_of(model), prompt_of(model, 5, seed=6)
    cache, want_cache = (make_cache(model, 1024) for _ in range(2))
    want, _, _ = decode(model, prompt, 11, want_cache, stop=6)
    got, _, _ = decode(model, prompt, 11, cache, stop=6, with_logprobs=False)
    assert got == want and len(got) == 7
    assert launches == [4, 4, 2]  # the third queued before the second was read
    assert cache[0].offset == want_cache[0].offset == len(prompt) + 7
    want, _, _ = decode(model, turn, 9, want_cache)
    got, _, _ = decode(model, turn, 9, cache, with_logprobs=False)
    assert got == want and cache[0].offset == want_cache[0].offset
    launches.clear()
    assert decode(model, prompt, 1, with_logprobs=False)[0] == decode(model, prompt, 1)[0]
    assert decode(model, prompt, 2, with_logprobs=False)[0] == decode(model, prompt, 2)[0]
    assert launches == [1]
    # a one-token prompt into an empty cache: its first token from the eager pass, then chunks
    (got, _, cache), (want, _, want_cache) = (decode(model, prompt[:1], 7, **kwargs)
                                              for kwargs in (dict(with_logprobs=False), {}))
    assert got == want and cache[0].offset == want_cache[0].offset == 7
    assert launches == [1, 4, 2]


def test_stream_stops_at_a_stop_token_inside_a_chunk(launches, monkeypatch, smollm2):
    """stream_generate with SmolLM2's tokenizer: a stop token in the middle of a chunk ends the
    answer there (finish "stop"), with the text and tokens of one step at a time and no
    log-probabilities (with_logprobs=False)."""
    model, tokenizer = quantized(MODELS["llama"], "rms"), smollm2[1]
    prompt = prompt_of(model)
    tokens = decode(model, prompt, 11)[0]
    # the first token after the first chunk's not seen before (a stop token ends at its first)
    stop = next(t for i, t in enumerate(tokens) if i >= 5 and t not in tokens[:i])
    monkeypatch.setattr(tokenizer, "eos_token_ids", {stop})
    want = list(stream_generate(model, tokenizer, prompt, 11))
    got = list(stream_generate(model, tokenizer, prompt, 11, with_logprobs=False))
    assert [r.token for r in got] == [r.token for r in want] == tokens[:tokens.index(stop) + 1]
    assert [r.text for r in got] == [r.text for r in want]
    assert got[-1].finish_reason == "stop" and all(r.logprobs is None for r in got)
    assert launches == [4, 4, 2]


def test_only_greedy_requests_without_logprobs_take_chunks(launches):
    """Sampling, a repetition penalty, log-probabilities asked for, or the eager path: one step at
    a time, as before (no chunk queued, log-probabilities yielded)."""
    model = quantized(MODELS["llama"], "flash")
    prompt = prompt_of(model)
    for kwargs in (dict(sampler=make_sampler_for(0.7)),
                   dict(logits_processors=make_processors(1.3)), dict(with_logprobs=True),
                   dict(compiled=False)):
        kwargs = dict(dict(with_logprobs=False), **kwargs)
        _, lps, _ = decode(model, prompt, 6, **kwargs)
        assert all(lp is not None for lp in lps), kwargs
    assert not launches


def test_bench_runs_chunks_and_one_launch_a_token(launches):
    """The decode bench's greedy runs take chunks (our_runner reads no log-probabilities); its mode
    flash-step keeps the chunk kernel off (one launch a token, as before it)."""
    model = quantized(MODELS["llama"], "flash")
    prompt = mx.array(prompt_of(model))
    assert decode_bench.parse_modes("flash,flash-step") == ["flash", "flash-step"]
    assert "one launch a token" in decode_bench.mode_line("flash-step")
    assert len(list(decode_bench.our_runner(model, None, ("decode_chunk",))(prompt, 6))) == 6
    assert not launches
    assert len(list(decode_bench.our_runner(model, None)(prompt, 6))) == 6
    assert launches == [4, 1]


def test_bench_chunk_steps_checked(tmp_path):
    """The bench's --chunk-steps (chunked.STEPS for its runs) takes 1 to 64: else a one-line
    error before any model loads."""
    r = in_process(bench_main, "--tiny", "--out", str(tmp_path), "--chunk-steps", "0")
    assert r.returncode == 2 and "--chunk-steps takes 1 to 64, not 0" in r.stderr


def test_models_without_a_chunk_form_are_refused():
    """Only the Llama family's and OpenELM's structure (embedding, blocks, final norm, head) has a
    chunk form, with quantized blocks the whole-step kernel computes: Gemma 3 (its embeddings
    scaled), Qwen 2's biases and full precision have none."""
    assert chunked.spec(quantized(MODELS["llama"], "flash")) is not None
    assert chunked.parts(random_model(GEMMA3, "flash")) is None
    qwen2 = quantized(dict(QWEN2, attention_bias=True), "flash")
    assert chunked.parts(qwen2) is not None and chunked.spec(qwen2) is None
    assert chunked.spec(random_model(TINY_LLAMA, "flash")) is None


def test_disabled_by_name(monkeypatch):
    """With the CUDA backend (stood in for), the kernel takes a model's spec and caches, and not
    where it is disabled (MLX_FLASHNORM_DISABLE=decode_chunk, or decode_layers, whose body it
    runs: forms.DISABLED) or where its caches are of another dtype; a request asks for its
    self-check only where both are on (with decode_layers off the check would pass comparing the
    fallback with itself, and a pass is kept on disk)."""
    model = quantized(MODELS["openelm"], "flash")
    spec = chunked.spec(model)
    cache = make_cache(model, 1024)
    model(mx.array([[1, 2, 3]]), cache=cache)
    kv = [c.state for c in cache]
    monkeypatch.setattr(forms, "use_gpu", lambda name=None: name not in forms.DISABLED)
    monkeypatch.setattr(step, "gpu_backend", lambda: "cuda")
    assert chunked.chunk_supported(spec, kv)
    for name in ("decode_chunk", "decode_layers"):
        with forms.without(name):
            assert not chunked.chunk_supported(spec, kv)
    assert not chunked.chunk_supported(spec, [(k.astype(mx.float16), v) for k, v in kv])
    checked = []
    monkeypatch.setattr(kernels, "self_check", lambda names=None: checked.append(names) or True)
    compiled = compiled_decode(model, chunk=True)
    with forms.without("decode_layers"):
        assert not compiled.runs(kv) and not checked
    assert compiled.runs(kv) and checked == [["decode_chunk"]]


def test_self_check_argmaxes_are_decisive():
    """The self-check's tokens (float16, its dtype on a GPU) are decided by margins far past half
    precision's rounding: each step's two largest logits of the reference at least 3% of the
    largest logit apart, so that the kernel, which rounds otherwise, must pick the same tokens;
    and the tokens differ from step to step in two of its three modes (a head that repeats its
    input token would check little)."""
    logits = []
    out = chunk.check_decode_chunk(functools.partial(chunk.reference, logits=logits))
    assert len(logits) == 3 * 4 and out[1].dtype == build.CHECK_DTYPE == mx.float16
    for lg in logits:
        top = mx.sort(lg.astype(mx.float32))
        assert (top[-1] - top[-2]).item() >= 0.03 * mx.abs(top).max().item()
    tokens = [out[i].tolist() for i in range(0, len(out), 5)]
    assert sum(len(set(t)) > 1 for t in tokens) >= 2, tokens


def test_source_composes_the_step_body(tmp_path, monkeypatch):
    """decode_chunk's CUDA is step.cu's body with chunk.cu's loop on its STEPS_OPEN and STEPS_CLOSE
    lines (decode_layers fills them with a comment): the layers once, no marker left; a renamed
    marker in a copy of chunk.cu raises instead of leaving a hole."""
    body, header = chunk.source(2)
    assert "{{" not in body + header and body.count("for (int l = 0; l < NL; ++l)") == 1
    assert "for (int it = 0; it < steps[0]; ++it)" in body and "fn_embed" in header
    assert step.source(2)[0].count("STEPS_") == 2  # decode_layers: the two comment lines
    for f in step.CUDA.iterdir():
        (tmp_path / f.name).write_text(f.read_text())
    (tmp_path / "chunk.cu").write_text((tmp_path / "chunk.cu").read_text().replace("{{FIELDS}}",
                                                                                   "{{FIELD}}"))
    monkeypatch.setattr(step, "CUDA", tmp_path)
    with pytest.raises(ValueError):
        chunk.source(2)


# On a CUDA GPU (the lead's runs): the kernel itself.

def agree_until_tie(got, want, lps, dtype):
    """How many greedy tokens of the chunked path (got) equal one step at a time's (want, with its
    log-probabilities lps) before the first that differs, which must be a tie there: the two
    tokens' log-probabilities within test_step_kernel.tie_bound (the kernel's head sums in another
    order than MLX's quantized matmul, so at such a tie either token may be picked)."""
    for s, (a, b) in enumerate(zip(got, want)):
        if a != b:
            values = [lps[s][a].item(), lps[s][b].item()]
            assert abs(values[0] - values[1]) <= tie_bound(dtype, max(map(abs, values))), (s, a, b)
            return s
    return len(want)


def ties(model, prompt, steps, dtype):
    """Greedy tokens in chunks against one step at a time for `steps` tokens after prompt: where
    they part, at a tie (agree_until_tie), the comparison goes on after the prompt grown by the
    tokens agreed on and one step at a time's; the number of ties."""
    count, done = 0, 0
    while done < steps:
        want, lps, _ = decode(model, prompt, steps - done)
        got, _, _ = decode(model, prompt, steps - done, with_logprobs=False)
        n = agree_until_tie(got, want, lps, dtype)
        if n == len(want):
            return count
        count, done, prompt = count + 1, done + n + 1, prompt + want[:n + 1]
    return count


@pytest.mark.skipif(not CUDA, reason="the kernel runs on CUDA only")
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_kernel_matches_reference(dtype, monkeypatch):
    """The launch against its reference on the self-check's inputs in each dtype
    (check_decode_chunk: each mode, tied and untied heads), and with QK-norm (Sec. 4 in flash,
    the model's own in rms): the tokens, up to a step whose reference margin is within the dtype's
    rounding (float16's without QK-norm are all decisive: test_self_check_argmaxes_are_decisive),
    and the cache rows written until then."""
    monkeypatch.setattr(build, "CHECK_DTYPE", dtype)
    tol = {mx.float32: 1e-3, mx.float16: 1e-2, mx.bfloat16: 5e-2}[dtype]
    # the self-check's modes (float16: decisive), then those with QK-norm
    for modes, decisive in ((slice(0, 5, 2), dtype == mx.float16), (slice(1, 5, 2), False)):
        logits = []
        got = chunk.check_decode_chunk(modes=modes)
        assert "decode_chunk" not in forms.DISABLED  # the kernel ran, not its reference
        assert any(name == "fn_decode_chunk" for name, _ in build.VARIANTS)
        want = chunk.check_decode_chunk(functools.partial(chunk.reference, logits=logits), modes)
        for m in range(len(got) // 5):  # a mode's tokens, then 4 caches' rows (2 layers, k, v)
            tokens, expected = got[5 * m].tolist(), want[5 * m].tolist()
            n = next((s for s, (a, b) in enumerate(zip(tokens, expected)) if a != b), 4)
            assert n == 4 or not decisive, (m, tokens, expected)
            if n < 4:  # a tie at the first difference: the reference's margin within rounding
                top = mx.sort(logits[4 * m + n].astype(mx.float32))
                assert (top[-1] - top[-2]).item() <= 2 * tol * mx.abs(top).max().item(), (m, n)
            for a, b in zip(got[5 * m + 1:5 * m + 5], want[5 * m + 1:5 * m + 5]):
                a, b = a[..., :n, :].astype(mx.float32), b[..., :n, :].astype(mx.float32)
                assert (mx.abs(a - b).max() <= tol * mx.abs(b).max()).item()


@pytest.mark.skipif(not CUDA, reason="the kernel runs on CUDA only")
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("norm", ["flash", "rms", "none"])
def test_kernel_decodes_like_one_step_at_a_time(queued, name, dtype, norm):
    """With the kernel (chunks of chunked.STEPS), a random model's greedy tokens (Llama, its
    untied head, Qwen 3, OpenELM; each norm mode; half precision) are one step at a time's but at
    ties (ties: at most 3 in 80 tokens), after a short prompt and after 400 tokens."""
    model = quantized(MODELS[name], norm, dtype)
    count = sum(ties(model, prompt_of(model, n), 40, dtype) for n in (8, 400))
    assert queued and "decode_chunk" not in forms.DISABLED  # chunked, its self-check passed
    assert count <= 3, count


@pytest.mark.skipif(not CUDA, reason="the kernel runs on CUDA only")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("norm", ["flash", "rms", "none"])
def test_kernel_on_real_weights(queued, dtype, norm):
    """SmolLM2 (the shipped Q4_1 GGUF: 8-bit tied embedding, 4-bit layers): 48 greedy tokens in
    chunks are one step at a time's but at ties (ties: at most 2 in 96), after a chat prompt and
    after 1800 tokens of Pride and Prejudice; the kernel ran (its variant launched, its self-check
    passed)."""
    from pathlib import Path

    model, tok = load(None, norm=norm, dtype=dtype, progress=False)
    text = (Path(__file__).parent / "data" / "pride_and_prejudice_ch1-3.txt").read_text()
    prompts = (tok.encode("The capital of France is Paris. The capital of Germany is"),
               tok.encode(text)[:1800])
    count = sum(ties(model, list(prompt), 48, getattr(mx, dtype)) for prompt in prompts)
    assert queued and "decode_chunk" not in forms.DISABLED
    assert any(name == "fn_decode_chunk" for name, _ in build.VARIANTS)
    assert count <= 2, count
