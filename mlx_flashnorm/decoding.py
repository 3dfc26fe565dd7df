"""The decoding core that the generate command, the chat and the serving engine share: KV-cached
prefill, the compiled one-token step over a static cache, sampling, streaming, and loading a model
from the shared flags."""
import math
import sys
import time
from contextlib import closing
from functools import partial
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from . import constraints, forms, kernels
from .cache import StaticKVCache, make_cache
from .chat_template import encode_chat, set_chat_template
from .errors import UserError
from .flashnorm import kv_buffers
from .loader import load
from .lockstep import quiet

MAX_SEED = 2**64 - 1  # mx.random.seed takes an unsigned 64-bit integer


@dataclass
class Response:
    text: str  # the new piece of text (may be empty while a multi-byte character is incomplete)
    token: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: Optional[str] = None  # "stop" (EOS), "length", or None while generating
    # the step's log-probabilities over the vocabulary (after logits_processors, before the
    # sampler's temperature and filters): what the token was drawn from
    logprobs: Optional[mx.array] = None


def context_length(model):
    return model.args.context_length


CAPACITY_STEP = 1024  # static caches come in multiples of this many positions (few step shapes)


def cache_capacity(model, needed):
    """Positions a static cache gets for `needed`: the next multiple of CAPACITY_STEP, at most the
    model's context. The compiled step (and MLX's kernels) are specialized to the cache's shape, so
    requests of any length inside one bucket reuse them."""
    return min(context_length(model), -(-needed // CAPACITY_STEP) * CAPACITY_STEP)


def decode_offset(n):
    """The offset argument of compiled_decode's step for position n: an int32 array of 4 elements,
    the position first. MLX's CUDA backend keeps every array of 8 bytes or less in one managed-
    memory page, which the host also touches every step (the sampled token), so a kernel's read
    of a 1-element offset waits on it; 16 bytes live in device memory (bench/RESULTS.md, "GPU time
    per kernel")."""
    return mx.array([n] * 4, mx.int32)


def position(offset):
    """The position in a decode_offset array, as a view of its buffer (offset[0] would be a
    gather: a new 4-byte array)."""
    return offset[:1].reshape(())


def structure(model):
    """Every link of the model's tree (container, key, child: a submodule, list or array) and
    every container's size, flat. A compiled step holds the arrays it was traced with, so it is
    valid while each link still holds the same object and no container gained or lost one (a
    weight replaced, a module swapped or added). Checking that costs a request far less than
    walking model.parameters() (bench/RESULTS.md, "Time to first token")."""
    links, sizes, todo = [], [], [model]
    while todo:
        c = todo.pop()
        sizes.append((c, len(c)))
        for k, v in (c.items() if isinstance(c, dict) else enumerate(c)):
            if isinstance(v, (mx.array, dict, list, tuple)):
                links.append((c, k, v))
                if not isinstance(v, mx.array):
                    todo.append(v)
    return links, sizes


class CompiledStep:
    """A model's compiled decode step with the structure() it was traced over."""

    def __init__(self, model, fn):
        self.fn = fn
        self.links, self.sizes = structure(model)

    def current(self):
        return all(len(c) == n for c, n in self.sizes) and all(c[k] is v for c, k, v in self.links)


def compiled_decode(model, logits=False):
    """The 1-token forward pass as one compiled function of (token, offset, kv buffers), made once
    per model and kept on it: every request reuses it (MLX traces it again only for a new cache
    shape or dtype; a changed model gets a new one). offset: decode_offset(position); the step
    returns (log-probabilities, the next offset, kv). logits: a second step that returns the raw
    logits instead, for logits processors (a repetition penalty depends on the logits' signs)."""
    name = "_compiled_logits" if logits else "_compiled_decode"
    kept = getattr(model, name, None)
    if kept is None or not kept.current():
        def step(y, offset, kv):
            cache = [StaticKVCache(k.shape[2]) for k, _ in kv]
            for c, (k, v) in zip(cache, kv):
                c.keys, c.values, c.offset = k, v, position(offset)
            out = model(y[None], cache=cache)[:, -1, :]
            if not logits:
                out = out - mx.logsumexp(out, axis=-1, keepdims=True)
            return out, offset + 1, [c.state for c in cache]

        # a plain attribute, not a child
        setattr(model, name, CompiledStep(model, mx.compile(step)))
    return getattr(model, name).fn


# prompt lengths a compiled prefill pads to: at most twice the tokens to 256, 255 more above
PREFILL_BUCKETS = (16, 32, 64, 128, 256) + tuple(range(512, 2049, 256))


def prefill(model, tokens, cache, compiled=None):
    """Run tokens (ids: a list or a 1-D array) into cache (StaticKVCaches, or mlx-lm's KVCaches),
    queued; no logits computed. compiled (None: forms.compiled_prefill()): the ids padded at their
    end to the next of PREFILL_BUCKETS go through one mx.compile'd forward pass (kept on the model
    as compiled_decode's step; traced once per bucket, capacity, and empty cache or not): no graph
    for Python to build, fewer kernels, one causal mask for every layer, which keeps the padding
    out of every real position (its keys and values land past the offset, unread until later
    tokens write over them). A KVCache gets buffers of cache_capacity positions. Eager where the
    bucket does not fit the cache, or for other caches."""
    n, start, static = len(tokens), cache[0].offset, isinstance(cache[0], StaticKVCache)
    size = next((b for b in PREFILL_BUCKETS if n <= b), None)
    capacity = cache[0].capacity if static else cache_capacity(model, start + (size or 0))
    if (not (forms.compiled_prefill() if compiled is None else compiled) or size is None
            or start + size > capacity or type(cache[0]) not in (StaticKVCache, KVCache)):
        model(mx.array(tokens)[None], cache=cache)
        return
    kept = getattr(model, "_compiled_prefill", None)
    if kept is None or not kept.current():
        model._compiled_prefill = CompiledStep(model, mx.compile(partial(_fill, model)))
    if start:  # the buffers (a KVCache's grown to capacity, as its own update would grow them)
        grow = [(0, 0), (0, 0), (0, capacity - start), (0, 0)]
        kv = [(c.keys, c.values) if static else (mx.pad(c.keys[..., :start, :], grow),
                                                 mx.pad(c.values[..., :start, :], grow))
              for c in cache]
    else:  # made here, not in the trace, where prefill_rows will write them (kv_buffers)
        kv = (kv_buffers(model.layers, capacity) if kernels.use_decode_layers("prefill_rows")
              else None)
    ids = mx.pad(mx.array(tokens), (0, size - n))
    kv = model._compiled_prefill.fn(ids, decode_offset(start), kv, capacity)
    for c, (k, v) in zip(cache, kv):
        c.keys, c.values, c.offset = k, v, start + n


def _fill(model, ids, offset, kv, capacity):
    """prefill's forward pass from a decode_offset into kv's buffers of capacity positions, or new
    ones (kv None): the ids attend over the whole buffers (StaticKVCache.make_mask's mask)."""
    at = position(offset)
    cache = [StaticKVCache(capacity, at) for _ in model.layers]
    for c, (k, v) in zip(cache, kv or ()):
        c.keys, c.values = k, v
    model(ids[None], cache=cache)
    return [c.state for c in cache]


def generate_step(prompt, model, sampler=None, max_tokens=256, prefill_step=2048, compiled=None,
                  cache=None, logits_processors=(), constraint=None):
    """Yield (token, logprobs) one at a time. The next step is queued on the device
    (async_eval) before the current token is handed to the caller.

    logits_processors: functions (tokens, logits) -> logits applied in turn to each step's logits
    (shape 1 x vocabulary) before the log-softmax and the sampler, as mlx-lm's are (its
    sample_utils.make_logits_processors makes them): tokens is every token so far, the prompt's
    and those generated (not those of an earlier `cache`).

    compiled: decode with a StaticKVCache of cache_capacity(prompt + max_tokens) positions and the
    model's compiled 1-token step (fast where our kernels run); False: the plain forward pass over
    mlx-lm's growing KVCache (the reference), or over `cache` as given; None (default): False on
    the portable path (forms.compiled_decode) or for a cache of mlx-lm's kinds (eager_cache), else
    True.
    prefill_step: prompt tokens per prefill chunk (mlx-lm's default), bounding attention scratch.
    cache: a cache from make_cache that already holds earlier tokens (a chat's previous turns):
    only `prompt` is prefilled after them. Compiled, it must be a StaticKVCache with room for
    prompt + max_tokens more positions. Once the generator ends or is closed the cache holds
    every token fed to the model (its offset counts them: the last token yielded may be missing).

    constraint: a token mask that depends on the tokens generated (constraints.Constraint: a
    grammar), with mask(logprobs) (the refused tokens at -inf) and accept(token): each token is
    drawn from the masked log-probabilities (those yielded are the model's, unmasked). The mask of
    token n+1 needs token n on the host: step n+1's forward pass is queued before token n is read
    (as without one), and its sampling after, so the host computes the mask while the device runs
    the forward pass."""
    sampler = sampler or make_sampler(0.0)
    if compiled is None:
        compiled = forms.compiled_decode() and (cache is None
                                                or isinstance(cache[0], StaticKVCache))
    if cache is None:
        cache = make_cache(model, cache_capacity(model, prompt.size + max_tokens) if compiled
                           else None)
    elif compiled and cache[0].offset + prompt.size + max_tokens > cache[0].capacity:
        raise ValueError(f"the cache holds {cache[0].capacity} positions, "
                         f"{cache[0].offset + prompt.size + max_tokens} are needed")

    logits_processors = logits_processors or ()  # (mlx-lm's None too)
    seen = prompt  # the tokens so far, for logits_processors

    def pick(logits, normalized=False):
        """(token, log-probabilities) from a step's logits; normalized: they are log-probabilities
        already (the compiled step's, where no processor needs the raw logits)."""
        nonlocal seen
        for process in logits_processors:
            logits = process(seen, logits)
        logprobs = logits if normalized else logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        y = sampler(logprobs if constraint is None else constraint.mask(logprobs))
        if logits_processors:
            seen = mx.concatenate([seen, y.astype(seen.dtype)])
        return y, logprobs.squeeze(0)

    def eager_forward(tokens):
        return model(tokens[None], cache=cache)[:, -1, :], False

    def eager_step(tokens):
        return pick(*eager_forward(tokens))

    # Prefill all but the last prompt token in chunks (bounding the attention scratch memory).
    # Only the cache is evaluated, so the logits of those positions are never computed.
    while prompt.size > 1:
        n = min(prefill_step, prompt.size - 1)
        prefill(model, prompt[:n], cache, None if compiled else False)
        mx.eval([c.state for c in cache])
        prompt = prompt[n:]
    # The last prompt token goes through the decode step too: compiled, that is one replay, not a
    # second eager forward pass for Python to build (bench/RESULTS.md, "Prefill"); but a
    # one-token prompt into an empty cache runs eagerly, which allocates the buffers.
    first = eager_forward(prompt) if compiled and cache[0].keys is None else None

    if not compiled:
        forward = eager_forward
    else:
        decode = compiled_decode(model, logits=bool(logits_processors))
        offset, kv = decode_offset(cache[0].offset), [c.state for c in cache]
        for c in cache:  # the buffers now live in kv alone, so each step can update them in place
            c.keys = c.values = None

        def forward(y):
            nonlocal offset, kv
            out, offset, kv = decode(y.astype(mx.uint32), offset, kv)  # one trace: samplers' dtype
            return out, not logits_processors

    def step(y):
        return pick(*forward(y))

    try:
        if constraint is not None:
            yield from constrained(forward, pick, first or forward(prompt), max_tokens, constraint)
            return
        y, logprobs = pick(*first) if first else step(prompt)
        mx.async_eval(y, logprobs)
        for n in range(max_tokens):
            if n + 1 < max_tokens:
                next_y, next_logprobs = step(y)
                mx.async_eval(next_y, next_logprobs)
            yield y.item(), logprobs
            if n + 1 < max_tokens:
                y, logprobs = next_y, next_logprobs
    finally:
        if compiled:  # hand the buffers back, for a caller that keeps the cache
            for c, (k, v) in zip(cache, kv):
                c.keys, c.values, c.offset = k, v, position(offset).item()


def constrained(forward, pick, out, max_tokens, constraint):
    """generate_step's loop under a constraint: out, the first forward pass's (logits,
    normalized); each token picked from the masked log-probabilities once the one before it is
    read, the next forward pass queued before that read."""
    y, logprobs = pick(*out)
    mx.async_eval(y, logprobs)
    for n in range(max_tokens):
        if n + 1 < max_tokens:
            out = forward(y)
            mx.async_eval(out[0])
        token = y.item()
        constraint.accept(token)
        yield token, logprobs
        if n + 1 < max_tokens:
            y, logprobs = pick(*out)  # the mask, on the host, while the device runs out
            mx.async_eval(y, logprobs)


WARMUP_PROMPT = 16  # tokens: prefill runs MLX's multi-token kernels, not only its 1-token ones
WARMUP_STEPS = 3  # tokens generated: the one after prefill, then two decode steps


def warmup(model, compiled=None):
    """Play one short throwaway request (a prompt of WARMUP_PROMPT tokens, WARMUP_STEPS greedy
    tokens, a cache of the first bucket, dropped after), so that the first real request finds the
    decode step traced and MLX's kernels and ours compiled. Greedy sampling draws no random
    numbers, so later results are those of a fresh model. MLX keeps compiled functions per thread:
    call it on the thread that will generate. compiled: as generate_step takes it."""
    prompt = (mx.arange(min(WARMUP_PROMPT, context_length(model) - WARMUP_STEPS))
              % model.args.vocab_size)
    for _ in generate_step(prompt, model, max_tokens=WARMUP_STEPS, compiled=compiled):
        pass


def make_sampler_for(temp=0.0, top_p=1.0, top_k=0, min_p=0.0):
    """Greedy when temp == 0; else temperature sampling restricted by top-p (1.0: off), top-k (0:
    off) and min-p (0.0: off; keeps the tokens at least min_p times as likely as the likeliest)."""
    if not 0 <= temp < math.inf:  # NaN fails both
        raise UserError(f"temp must be at least 0 (0 is greedy) and finite, not {temp}")
    if not 0 < top_p <= 1:
        raise UserError(f"top-p must be above 0 and at most 1 (1 is off), not {top_p}")
    if top_k < 0:
        raise UserError(f"top-k must be at least 0 (0 is off), not {top_k}")
    if not 0 <= min_p <= 1:
        raise UserError(f"min-p must be from 0 to 1 (0 is off), not {min_p}")
    return make_sampler(temp, top_p=top_p if top_p < 1 else 0.0, min_p=min_p, top_k=top_k)


def make_processors(repetition_penalty=None, repetition_context_size=20):
    """mlx-lm's logits processors for a repetition penalty (None or 1.0: off): the logit of each
    token among the last repetition_context_size ones (prompt included) is divided by the penalty
    where positive and multiplied by it where negative."""
    if repetition_penalty is not None and not 0 < repetition_penalty < math.inf:
        raise UserError("repetition-penalty must be above 0 (1 is off) and finite, "
                        f"not {repetition_penalty}")
    if repetition_context_size < 1:
        raise UserError("repetition-context-size must be at least 1, "
                        f"not {repetition_context_size}")
    if repetition_penalty in (None, 1.0):
        return []
    return make_logits_processors(repetition_penalty=repetition_penalty,
                                  repetition_context_size=repetition_context_size)


KV_BITS = (2, 3, 4, 5, 6, 8)


def eager_cache(model, max_kv_size=None, kv_bits=None, kv_group_size=64):
    """mlx-lm's caches, for the eager decode path: a RotatingKVCache of max_kv_size positions (the
    first 4 kept, the rest a sliding window: generation goes on past it), or a QuantizedKVCache
    (keys and values in kv_bits, groups of kv_group_size along the head dimension), or a KVCache."""
    if max_kv_size is not None and kv_bits is not None:
        raise UserError("--max-kv-size and --kv-bits do not combine (mlx-lm's rotating cache is "
                        "not quantized): pass one of them")
    if max_kv_size is not None:
        if max_kv_size < 8:
            raise UserError(f"max-kv-size must be at least 8 positions, not {max_kv_size}")
        return [RotatingKVCache(max_size=max_kv_size, keep=4) for _ in model.layers]
    if kv_bits is not None:
        head_dim = model.args.head_dim
        if kv_bits not in KV_BITS:
            raise UserError(f"kv-bits must be one of {', '.join(map(str, KV_BITS))}, not {kv_bits}")
        if kv_group_size not in (32, 64, 128) or head_dim % kv_group_size:
            raise UserError(f"kv-group-size must be 32, 64 or 128 and divide the head size "
                            f"({head_dim}), not {kv_group_size}")
        return [QuantizedKVCache(group_size=kv_group_size, bits=kv_bits) for _ in model.layers]
    return [KVCache() for _ in model.layers]


def check_limits(max_tokens, seed):
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise UserError(f"max-tokens must be a whole number of at least 1, not {max_tokens!r}")
    if seed is not None and not (isinstance(seed, int) and 0 <= seed <= MAX_SEED):
        raise UserError(f"seed must be a whole number from 0 to {MAX_SEED}, not {seed!r}")


def encode_prompt(tokenizer, prompt, chat_template=True, system_prompt=None, vocab=None,
                  parse_special=False):
    """Token ids of a prompt string (through the chat template where there is one and
    chat_template, after the system message system_prompt: encode_chat, parse_special as there)
    or of a list of ids as it is; with vocab (the model's vocabulary size), each checked to lie
    inside it, so that no id reads beyond the embedding."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise UserError("the prompt is empty; pass some text with --prompt")
        if chat_template and tokenizer.has_chat_template:
            system = [{"role": "system", "content": system_prompt}] if system_prompt else []
            prompt = encode_chat(tokenizer, system + [{"role": "user", "content": prompt}],
                                 parse_special)
        elif system_prompt:
            raise UserError("a system prompt needs a chat template: this tokenizer has none (pass "
                            "--chat-template) or --ignore-chat-template is set")
        else:
            prompt = tokenizer.encode(prompt)
    if len(prompt) == 0:
        raise UserError("the prompt is empty; pass some text with --prompt")
    if vocab is not None:
        check_ids(prompt, vocab)
    return list(prompt)


def check_ids(ids, vocab):
    """Token ids lie from 0 to vocab - 1, the rows of the model's embedding (one min and max)."""
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab:
        raise UserError(f"the prompt holds token id {lo if lo < 0 else hi}, outside the model's "
                        f"vocabulary of {vocab} (ids 0 to {vocab - 1}); its ids must come from "
                        "this model's tokenizer")


def stream_generate(model, tokenizer, prompt, max_tokens=256, temp=0.0, top_p=1.0, top_k=0,
                    seed=None, chat_template=True, prefill_step=512, cache=None, min_p=0.0,
                    logits_processors=(), system_prompt=None, max_kv_size=None, kv_bits=None,
                    kv_group_size=64, sampler=None, json_schema=None, grammar=None):
    """Yield a Response per generated token; prompt is a string or a list of token ids.
    cache: a cache list holding earlier tokens, to continue after them (generate_step): a
    StaticKVCache list, or mlx-lm caches (eager_cache), which decode eagerly. max_kv_size, kv_bits:
    without a cache, decode eagerly over eager_cache's rotating or quantized cache.
    logits_processors: as generate_step takes them (make_processors builds a repetition penalty).
    sampler: as mlx-lm takes it (mlx_lm.sample_utils.make_sampler's result, or any function of
    the (1, vocabulary) log-probabilities giving the (1,) token), in place of temp, top_p, top_k
    and min_p. json_schema: a JSON schema (a dict or its JSON text) the generated text follows
    (constrained decoding: the generation ends where the JSON text does); grammar: an llguidance
    grammar (constraints.py) instead."""
    check_limits(max_tokens, seed)
    if sampler is None:
        sampler = make_sampler_for(temp, top_p, top_k, min_p)
    elif (temp, top_p, top_k, min_p) != (0.0, 1.0, 0, 0.0):
        raise UserError("pass either a sampler or temp, top_p, top_k and min_p, not both")
    elif not callable(sampler):
        raise UserError(f"sampler must be a function of the log-probabilities, not {sampler!r}")
    constraint = make_constraint(tokenizer, model.args.vocab_size, json_schema, grammar)
    if cache is None and (max_kv_size is not None or kv_bits is not None):
        cache = eager_cache(model, max_kv_size, kv_bits, kv_group_size)
    tokens = encode_prompt(tokenizer, prompt, chat_template, system_prompt,
                           vocab=model.args.vocab_size)
    ctx = context_length(model)
    start = cache[0].offset if cache else 0
    if start + len(tokens) >= ctx:
        raise UserError(f"the prompt has {start + len(tokens)} tokens, the model's context is "
                        f"{ctx}: shorten the prompt")
    max_tokens = min(max_tokens, ctx - start - len(tokens))
    if seed is not None:
        mx.random.seed(seed)
    detok = tokenizer.detokenizer
    detok.reset()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    prompt_tps = 0.0
    n = 0
    steps = generate_step(mx.array(tokens), model, sampler, max_tokens, prefill_step, cache=cache,
                          logits_processors=logits_processors, constraint=constraint)
    with closing(steps):  # closed at once, so that a kept cache gets its buffers back
        for n, (token, logprobs) in enumerate(steps, 1):
            if n == 1:
                prompt_tps = len(tokens) / (time.perf_counter() - tic)
                tic = time.perf_counter()
            stop = token in tokenizer.eos_token_ids
            if not stop:
                detok.add_token(token)
            finish = "stop" if stop else ("length" if n == max_tokens else None)
            if finish:
                detok.finalize()
            gen_tps = (n - 1) / max(time.perf_counter() - tic, 1e-9) if n > 1 else 0.0
            yield Response(detok.last_segment, token, len(tokens), prompt_tps, n, gen_tps,
                           mx.get_peak_memory() / 1e9, finish, logprobs)
            if finish:
                break


def make_constraint(tokenizer, vocab, json_schema=None, grammar=None):
    """The constraints.Constraint of a JSON schema or an llguidance grammar (None for neither); a
    UserError for a schema or grammar that is not valid."""
    if json_schema is not None and grammar is not None:
        raise UserError("pass a JSON schema or a grammar, not both")
    if json_schema is None and grammar is None:
        return None
    try:
        grammar = grammar if json_schema is None else constraints.schema_grammar(json_schema)
        if error := constraints.check(grammar):
            raise ValueError(error)
        return constraints.Constraint(grammar, tokenizer, vocab)
    except ValueError as e:
        raise UserError(f"the {'grammar' if json_schema is None else 'JSON schema'} is not valid: "
                        f"{e}")


def generate(model, tokenizer, prompt, max_tokens=256, verbose=False, **kwargs) -> str:
    """The whole generated text (EOS excluded); kwargs as stream_generate takes them. verbose:
    print what mlx_lm.generate prints, the text as it comes between two rules, then the prompt's
    and the generation's tokens per second and the peak memory."""
    rule = "=" * 10
    if verbose:
        print(rule)
    text, r = "", None
    for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs):
        text += r.text
        if verbose:
            print(r.text, end="", flush=True)
    if verbose:
        print(f"\n{rule}")
        print(f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {r.peak_memory:.3f} GB")
    return text


def wants_warmup(args):
    """--warmup or --no-warmup as given, else on a GPU (where a first request compiles kernels for
    far longer than the warm-up runs) and not on the CPU: there MLX keeps the kernels it compiles
    on disk, so that after a machine's first run a first request pays little more than later ones
    (the step's trace, loading the kernels), while the warm-up's CPU prefill and steps take longer
    than that (bench/RESULTS.md, "Warm-up on the CPU")."""
    return mx.default_device() == mx.gpu if args.warmup is None else args.warmup


def load_from_args(args, warm=True):
    """Check the shared flags, then load the model they name and, if warm and wants_warmup(args),
    warm it up on this thread (warmup)."""
    check_limits(getattr(args, "max_tokens", 1), getattr(args, "seed", None))
    if args.norm == "none":
        print("warning: --norm none removes every normalization; the text is meaningless "
              "(it only measures a speed ceiling)", file=sys.stderr)
    model, tokenizer = load(args.model, norm=args.norm, bits=args.bits, dtype=args.dtype,
                            tokenizer=args.tokenizer, group_size=args.group_size)
    if getattr(args, "chat_template", None):
        set_chat_template(tokenizer, args.chat_template)
    quiet()  # under mlx.launch, rank 0 prints (lockstep.py)
    if warm and wants_warmup(args):
        warmup(model)
    return model, tokenizer
