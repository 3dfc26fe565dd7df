"""Where the time of a request goes, per mode: the profile behind the levers of issues 11 and 15.

    python -m mlx_flashnorm.bench.anatomy --shape smollm2-135m --pp 1792 [--cold MODE]

--cold MODE (run it first in a fresh process, one mode per process): the first request's parts,
each evaluated and timed on its own: loading, prefill, the eager first token, the compiled step's
trace (its first call) and its first evaluations, then the same request again.

Otherwise, for each mode in one process after a warm-up, medians of --reps:
- prefill: --pp tokens into a fresh cache (its keys and values, no logits), split into building
  the graph (Python; a compiled prefill's call), submitting it (MLX encodes every kernel on this
  thread) and waiting for the device; for our modes eager and compiled (decoding.prefill, padded
  to its bucket), and eager with each of our kernels switched off in turn (forms.DISABLED),
  which shows what each costs or saves.
- decode step (one token, the cache filled to --pp): build, submit, wait, each alone, and the
  time per token of a pipelined loop (the next step submitted before waiting, as generate_step
  does). Host-bound when build + submit is close to the pipelined time.
"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from .. import forms
from ..cache import make_cache
from ..errors import HelpFormatter, run_cli
from ..decoding import cache_capacity, compiled_decode, decode_offset, prefill
from .decode import PEER, device_name, load_mlx_lm, load_ours, random_checkpoint, random_shape

KERNELS = ("add_rss", "normalize", "rope_qkv", "qkv_rope", "gate_up", "decode_attention")


def now():
    return time.perf_counter()


def timed_eval(f):
    """(build, submit, wait) seconds of f()'s arrays: Python graph building, MLX encoding the
    kernels (async_eval), the device finishing."""
    t0 = now()
    out = f()
    t1 = now()
    mx.async_eval(out)
    t2 = now()
    mx.eval(out)
    return t1 - t0, t2 - t1, now() - t2


def load_mode(folder, mode, dtype):
    """The model of one mode (ours, or mlx-lm's for PEER) from a random checkpoint, 4-bit, group
    64."""
    if mode == PEER:
        return load_mlx_lm(folder, 4, dtype, 64)
    return load_ours(folder, mode, 4, dtype, 64)


def peer_cache(model):
    from mlx_lm.models.cache import make_prompt_cache
    return make_prompt_cache(model)


def prefill_fn(model, mode, prompt, compiled=False):
    def f():
        if mode == PEER:
            cache = peer_cache(model)
            model(prompt[None], cache=cache)
        else:
            cache = make_cache(model, cache_capacity(model, prompt.size + 8))
            prefill(model, prompt, cache, compiled)
        return [a for c in cache for a in c.state[:2]]
    return f


def decode_loop(model, mode, prompt):
    """(step(y) -> next token array, first token) with the cache filled by prompt; eager (as
    generate_step runs it) for mlx-lm and on the portable path, else our compiled step."""
    if mode == PEER or forms.portable():
        cache = peer_cache(model) if mode == PEER else make_cache(model)
        model(prompt[None, :-1], cache=cache)
        mx.eval([c.state for c in cache])
        return (lambda y: mx.argmax(model(y[None], cache=cache)[:, -1, :], axis=-1)), prompt[-1:]
    cache = make_cache(model, cache_capacity(model, prompt.size + 512))
    model(prompt[None, :-1], cache=cache)
    mx.eval([c.state for c in cache])
    decode = compiled_decode(model)
    state = {"offset": decode_offset(cache[0].offset), "kv": [c.state for c in cache]}

    def step(y):
        logprobs, state["offset"], state["kv"] = decode(y, state["offset"], state["kv"])
        return mx.argmax(logprobs, axis=-1)
    return step, prompt[-1:]


def medians(rows):
    return [statistics.median(col) for col in zip(*rows)]


def profile_decode(model, mode, prompt, reps):
    step, y = decode_loop(model, mode, prompt)
    for _ in range(4):
        y = step(y)
        mx.eval(y)
    rows = []
    for _ in range(reps * 8):
        y_in = y
        rows.append(timed_eval(lambda: step(y_in)))
        y = step(y_in)
        mx.eval(y)
    n = 64
    t = now()
    nxt = step(y)
    mx.async_eval(nxt)
    for _ in range(n):
        y, nxt = nxt, step(nxt)
        mx.async_eval(nxt)
        y.item()
    per_token = (now() - t) / n
    return medians(rows) + [per_token]


def profile_prefill(model, mode, prompt, reps, compiled=False):
    f = prefill_fn(model, mode, prompt, compiled)
    timed_eval(f)  # (a compiled one's trace)
    return medians([timed_eval(f) for _ in range(reps)])


def ms(xs):
    return " | ".join(f"{x * 1e3:.2f}" for x in xs)


def cold(mode, folder, args):
    t = now()
    model = load_mode(folder, mode, args.dtype)
    mx.eval(model.parameters())
    parts = [("load", now() - t)]
    prompt = mx.random.randint(0, 1000, (args.pp,))
    for round_ in ("first request", "same request again"):
        if mode == PEER:
            cache = peer_cache(model)
        else:
            cache = make_cache(model, cache_capacity(model, args.pp + 8))
        t = now()
        model(prompt[None, :-1], cache=cache)
        mx.eval([c.state for c in cache])
        parts.append((f"{round_}: prefill", now() - t))
        t = now()
        y = mx.argmax(model(prompt[None, -1:], cache=cache)[:, -1, :], axis=-1)
        mx.eval(y)
        parts.append((f"{round_}: eager first token", now() - t))
        if mode == PEER:
            for i in range(3):
                t = now()
                y = mx.argmax(model(y[None], cache=cache)[:, -1, :], axis=-1)
                mx.eval(y)
                parts.append((f"{round_}: step {i + 1}", now() - t))
            continue
        offset, kv = decode_offset(cache[0].offset), [c.state for c in cache]
        t = now()
        decode = compiled_decode(model)
        logprobs, offset, kv = decode(y, offset, kv)
        parts.append((f"{round_}: step 1 trace (call)", now() - t))
        t = now()
        mx.eval(logprobs, offset, kv)
        parts.append((f"{round_}: step 1 evaluation", now() - t))
        for i in (2, 3):
            t = now()
            logprobs, offset, kv = decode(mx.argmax(logprobs, axis=-1), offset, kv)
            mx.eval(logprobs, offset, kv)
            parts.append((f"{round_}: step {i}", now() - t))
    print(f"cold start, {mode}, {device_name()}, prompt {args.pp}, {args.dtype}, "
          f"MLX {mx.__version__}")
    print("| part | s |\n| --- | ---: |")
    for name, s in parts:
        print(f"| {name} | {s:.3f} |")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mlx_flashnorm.bench.anatomy",
                                description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--shape", default="smollm2-135m", help="random weights of this architecture")
    p.add_argument("--config", action="append", metavar="FILE", help="or of this HF config.json")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pp", type=int, default=1792, help="prompt tokens")
    p.add_argument("--dtype", default="float16", help="activation dtype")
    p.add_argument("--modes", default="rms,flash,mlx-lm", help="comma-separated")
    p.add_argument("--reps", type=int, default=5, help="measured repetitions")
    p.add_argument("--cold", metavar="MODE",
                   help="time the first request's parts in this fresh process")
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    args = p.parse_args(argv)
    name, config = random_shape(args)
    with tempfile.TemporaryDirectory() as tmp:
        folder = random_checkpoint(Path(tmp) / "m", config)
        if args.cold:
            return cold(args.cold, folder, args)
        modes = args.modes.split(",")
        models = {m: load_mode(folder, m, args.dtype) for m in modes}
        prompt = mx.random.randint(0, config.get("vocab_size", 32000), (args.pp,))
        print(f"{name}, {device_name()}, prompt {args.pp}, {args.dtype}, Q4 g64, "
              f"MLX {mx.__version__}, medians of {args.reps}; ms")
        print("\n| prefill | path | kernels off | build | submit | wait |\n"
              "| --- | --- | --- | ---: | ---: | ---: |")
        for m in modes:
            print(f"| {m} | eager | - | {ms(profile_prefill(models[m], m, prompt, args.reps))} |",
                  flush=True)
            if m == PEER:
                continue
            print(f"| {m} | compiled | - "
                  f"| {ms(profile_prefill(models[m], m, prompt, args.reps, True))} |", flush=True)
            if forms.use_gpu():
                for k in KERNELS:
                    with forms.without(k):
                        print(f"| {m} | eager | {k} "
                              f"| {ms(profile_prefill(models[m], m, prompt, args.reps))} |",
                              flush=True)
        # a round untimed, as long as the timed one: else the first mode timed pays for MLX's first
        # pass over the longer cache (bench/RESULTS.md, "Portable path")
        for m in modes:
            profile_decode(models[m], m, prompt, args.reps)
        print("\n| decode step | build | submit | wait | pipelined per token |\n"
              "| --- | ---: | ---: | ---: | ---: |")
        for m in modes:
            print(f"| {m} | {ms(profile_decode(models[m], m, prompt, args.reps))} |", flush=True)


if __name__ == "__main__":
    run_cli(main)
