"""Continuous batching (mlx_flashnorm.batch) against one request at a time (generate_step), for
every architecture in models/ with norm rms and flash; and the prompt cache (prompt_cache)."""
import mlx.core as mx
import pytest

import threading
import time
from types import SimpleNamespace

from mlx_flashnorm.serve import engine as engine_module
from mlx_flashnorm.serve.engine import SHRINK_AFTER, BatchEngine
from mlx_flashnorm.serve.sequence import Request
from mlx_flashnorm.serve.batch_worker import BatchWorker, warmup
from mlx_flashnorm.serve.requests import Generation
from mlx_flashnorm.decoding import cache_capacity, generate_step
from mlx_flashnorm.serve.prompt_cache import PromptCache

from conftest import GEMMA3, QWEN2, QWEN3, TINY_LLAMA, TINY_OPENELM, f32_tol, random_model

CONFIGS = {"llama": TINY_LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "openelm": TINY_OPENELM, "gemma3": GEMMA3}
STEPS = 12
LENGTHS = (5, 17, 1, 30)  # prompts; gemma3's window is 8 positions, so 17 and 30 cross it
TOL = 1e-4  # float32 log-probabilities: a batch sums in another order (padded attention, matmul rows)


@pytest.fixture(scope="module", params=[(a, n) for a in CONFIGS for n in ("rms", "flash")],
                ids=lambda p: "-".join(p))
def model(request):
    name, norm = request.param
    return random_model(dict(CONFIGS[name], max_position_embeddings=256, max_context_length=256), norm)


def prompt(model, n, seed=None):
    return mx.random.randint(0, model.args.vocab_size, (n,), key=mx.random.key(seed or n)).tolist()


def single(model, tokens, steps=STEPS):
    """(tokens, log-probabilities) of one request alone: the reference."""
    out = list(generate_step(mx.array(tokens), model, max_tokens=steps))
    return [t for t, _ in out], mx.stack([lp for _, lp in out])


def inserted_requests(monkeypatch):
    """The requests Slots.insert places from now on (a list it fills)."""
    from mlx_flashnorm.serve.slots import Slots

    inserted = []
    monkeypatch.setattr(Slots, "insert", lambda self, requests, *rest, f=Slots.insert: inserted.extend(
        requests) or f(self, requests, *rest))
    return inserted


def run(engine, requests, joins=None, after_step=None):
    """Step the engine until idle, adding requests[i] before step joins[i] and calling
    after_step() after each step; (events per request)."""
    joins = joins or [0] * len(requests)
    events = {id(r): [] for r in requests}
    step = 0
    while step <= max(joins) or engine.busy:
        for r, j in zip(requests, joins):
            if j == step:
                engine.add(r)
        for e in engine.step():
            events[id(e.request)].append(e)
        if after_step is not None:
            after_step()
        step += 1
    return [events[id(r)] for r in requests]


@pytest.mark.parametrize("feed", [0, 32])
def test_batched_greedy_equals_single(model, feed):
    """Four requests: two start together, one joins at step 3 (while the others decode), one with
    a long prompt at step 6; the second leaves early. feed 0: the long prompt is prefilled over 4
    steps in chunks of 8; feed 32: the newcomers' prompts are fed through the batch's decode steps,
    a token a step, no prefill call."""
    prompts = [prompt(model, n) for n in LENGTHS]
    reference = [single(model, p) for p in prompts]
    requests = [Request(p, max_tokens=5 if i == 1 else STEPS) for i, p in enumerate(prompts)]
    engine = BatchEngine(model, prefill_step=8, feed=feed)
    events = run(engine, requests, joins=[0, 0, 3, 6])
    assert engine.prefill_calls == (4 + 4 if feed == 0 else 4)  # the first two in chunks of 8, then the 30
    for r, ev, (tokens, lp) in zip(requests, events, reference):
        assert [e.token for e in ev] == r.generated == tokens[:r.max_tokens]
        got = mx.stack([e.logprobs for e in ev])
        assert mx.allclose(got, lp[:len(ev)], rtol=f32_tol(TOL), atol=f32_tol(TOL)).item()
        assert [e.finish_reason for e in ev] == [None] * (len(ev) - 1) + ["length"]
    assert len(set(reference[0][0])) > STEPS // 2  # a real sequence, not one token repeated
    assert engine.prefilled == sum(LENGTHS) and not engine.rows


def test_newcomers_together_share_one_prefill_call(model):
    """Four requests arriving together, prompts of 3 to 30 tokens, within one step's budget: one
    prefill call for all of them (each padded at its end), and each gets its one-request tokens
    and log-probabilities."""
    prompts = [prompt(model, n, seed=40 + n) for n in (3, 30, 12, 7)]
    requests = [Request(p, max_tokens=6) for p in prompts]
    engine = BatchEngine(model, prefill_step=4 * 29)
    events = run(engine, requests)
    assert engine.prefill_calls == 1 and engine.prefilled == sum(len(p) for p in prompts)
    for r, ev in zip(requests, events):
        tokens, lp = single(model, r.tokens, steps=6)
        assert r.generated == tokens
        assert mx.allclose(mx.stack([e.logprobs for e in ev]), lp, rtol=f32_tol(TOL), atol=f32_tol(TOL)).item()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_newcomers_together_on_real_weights(dtype):
    """SmolLM2 (the shipped GGUF) in half precision: three newcomers prefilled in one call get the
    greedy tokens each gets alone, and log-probabilities within the half-precision tests' 5e-2
    (relative to the largest)."""
    from mlx_flashnorm import load

    model, tok = load(None, norm="flash", dtype=dtype, progress=False)
    requests = [Request(tok.encode(t), max_tokens=2) for t in ("The capital of France is", "Water boils at",
                                                                "One, two, three,")]
    engine = BatchEngine(model)
    events = run(engine, requests)
    assert engine.prefill_calls == 1
    for r, ev in zip(requests, events):
        alone = list(generate_step(mx.array(r.tokens), model, max_tokens=2))
        assert r.generated == [t for t, _ in alone]
        want = mx.stack([lp for _, lp in alone]).astype(mx.float32)
        got = mx.stack([e.logprobs for e in ev]).astype(mx.float32)
        assert (mx.abs(got - want).max() <= 5e-2 * mx.abs(want).max()).item()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_newcomer_fed_on_real_weights(dtype, monkeypatch):
    """SmolLM2 (the shipped GGUF) in half precision: a newcomer fed its prompt through the decode
    steps beside a running request, and one after it that takes its slot (its prompt beginning
    with the first newcomer's), get the greedy tokens they get alone, and log-probabilities within
    the half-precision tests' 5e-2 (relative to the largest); no prefill call, no copy for them.
    Then a lone request at the idle engine runs solo, and a newcomer moves its row into the slots
    set aside: the same holds for both."""
    from mlx_flashnorm import load
    from mlx_flashnorm.serve.slots import Slots

    inserted, moved = inserted_requests(monkeypatch), []
    monkeypatch.setattr(Slots, "moved", lambda self, into, f=Slots.moved: moved.append(into.size) or f(self, into))
    model, tok = load(None, norm="flash", dtype=dtype, progress=False)
    running, late = Request(tok.encode("One, two, three,"), max_tokens=14), Request(tok.encode("Water boils at"), 2)
    again = Request(late.tokens + tok.encode(" sea level, and"), 2)
    engine = BatchEngine(model, prompt_cache=PromptCache(1 << 24))
    events = run(engine, [running, late, again], joins=[0, 1, 9])
    assert engine.prefill_calls == 1 and again not in inserted  # the running request alone prefilled
    assert again.cached >= len(late.tokens)  # from the slot late left
    lone, joiner = Request(tok.encode("The sky is"), max_tokens=6), Request(tok.encode("Snow is"), 2)
    events += run(engine, [lone, joiner], joins=[0, 2])
    assert moved == [2]
    for r, ev in zip((running, late, again, lone, joiner), events):
        alone = list(generate_step(mx.array(r.tokens), model, max_tokens=r.max_tokens))
        n = tied_from(r.generated, alone)
        want = mx.stack([lp for _, lp in alone[:n]]).astype(mx.float32)
        got = mx.stack([e.logprobs for e in ev[:n]]).astype(mx.float32)
        assert (mx.abs(got - want).max() <= 5e-2 * mx.abs(want).max()).item()


def tied_from(generated, alone, tie=2**-6):
    """How many of a batched request's greedy tokens are compared with its one-request ones: all,
    if equal; else up to the first that differs, which must be a tie alone (the two tokens'
    log-probabilities within `tie`, two bfloat16 units near 1.5: the batched step sums in another
    order, kernels.decode_rows); the tokens after it follow another text."""
    for i, ((t, lp), g) in enumerate(zip(alone, generated)):
        if g != t:
            assert abs(lp[g].item() - lp[t].item()) <= tie, f"token {i}: {g} where alone {t}, no tie"
            return i
    assert len(generated) == len(alone)
    return len(alone)


def test_newcomers_with_cached_prefixes_share_one_prefill_call(model, monkeypatch):
    """Three newcomers whose prompts begin with a cached one (prefixes of 20, 20 and 24 tokens
    cached) arriving together: one prefill call from the shortest prefix (the third's 4 more
    tokens computed again), gathered from the prompt cache's block with no one-row cache made for
    any of them, and each gets its one-request tokens."""
    system = prompt(model, 20, seed=1)
    a = system + prompt(model, 6, seed=2)
    engine = BatchEngine(model, prompt_cache=PromptCache(1 << 24))
    run(engine, [Request(a, max_tokens=2)])
    prompts = [system + prompt(model, 5, seed=7), system + prompt(model, 9, seed=8), a[:24] + prompt(model, 3, seed=9)]
    requests = [Request(p, max_tokens=6) for p in prompts]
    calls, before = engine.prefill_calls, engine.prefilled
    made, real = [], engine_module.one_row_cache
    monkeypatch.setattr(engine_module, "one_row_cache", lambda *a: made.append(a) or real(*a))
    run(engine, requests)
    assert engine.prefill_calls - calls == 1 and [r.cached for r in requests] == [20, 20, 20]
    assert made == []
    assert engine.prefilled - before == sum(len(p) - 20 for p in prompts)
    for r in requests:
        assert r.generated == single(model, r.tokens, steps=6)[0]


def test_newcomers_with_different_cached_prefixes_get_their_own(model):
    """Newcomers prefilled in one call whose cached prefixes are two different texts (each prefix
    copied once and gathered into its members' rows): each row attends to its own prefix, so each
    gets its one-request tokens."""
    a, b = prompt(model, 20, seed=11), prompt(model, 20, seed=12)
    engine = BatchEngine(model, prompt_cache=PromptCache(1 << 24))
    run(engine, [Request(a + prompt(model, 4, seed=13), max_tokens=2), Request(b + prompt(model, 4, seed=14), max_tokens=2)])
    requests = [Request(p, max_tokens=6) for p in (a + prompt(model, 5, seed=15), b + prompt(model, 7, seed=16),
                                                   a + prompt(model, 3, seed=17))]
    calls = engine.prefill_calls
    run(engine, requests)
    assert engine.prefill_calls - calls == 1 and [r.cached for r in requests] == [20, 20, 20]
    for r in requests:
        assert r.generated == single(model, r.tokens, steps=6)[0]


def test_newcomer_fed_from_its_cached_prefix_beside_running_rows(model):
    """A newcomer that arrives while a row decodes, its prompt beginning with a cached one, is fed
    only its other tokens through the decode steps (no prefill call) while the running row gets a
    token every step; both get their one-request tokens."""
    system = prompt(model, 20, seed=1)
    engine = BatchEngine(model, prompt_cache=PromptCache(1 << 24))
    run(engine, [Request(system + prompt(model, 6, seed=2), max_tokens=2)])
    running, late = Request(prompt(model, 7, seed=3), max_tokens=STEPS), Request(system + prompt(model, 9, seed=4), 6)
    engine.add(running)
    engine.step()
    calls, before = engine.prefill_calls, engine.prefilled
    engine.add(late)
    per_step = []
    while engine.busy:
        per_step.append([e.request for e in engine.step()])
    assert late.cached == 20 and engine.prefilled - before == 9 and engine.prefill_calls == calls
    assert all(running in s for s in per_step[:STEPS - 2])  # the running row never waited a step
    assert late.generated == single(model, late.tokens, 6)[0] and running.generated == single(model, running.tokens)[0]


@pytest.mark.parametrize("wait", [None, 1e-9])
def test_feed_wait_prefills_a_newcomer_where_steps_are_slow(llama, wait):
    """feed_wait bounds a fed newcomer's wait by the steps' measured periods: with a bound no step
    meets (1 ns), a newcomer beside a running row is prefilled in a call of its own, and one
    sharing a free slot's prefix at an idle engine is not fed into that slot either; with none, both
    are fed. Each gets its one-request tokens either way."""
    system = prompt(llama, 20, seed=1)
    engine = BatchEngine(llama, prompt_cache=PromptCache(1 << 24), feed_wait=wait)
    run(engine, [Request(system + prompt(llama, 6, seed=2), max_tokens=2)])
    running, late = Request(prompt(llama, 7, seed=3), max_tokens=STEPS), Request(system + prompt(llama, 9, seed=4), 6)
    engine.add(running)
    for _ in range(3):  # periods measured
        engine.step()
    calls = engine.prefill_calls
    engine.add(late)
    while engine.busy:
        engine.step()
    assert late.cached == 20 and engine.prefill_calls - calls == (0 if wait is None else 1)
    assert late.generated == single(llama, late.tokens, 6)[0] and running.generated == single(llama, running.tokens)[0]
    calls = engine.prefill_calls
    nxt = Request(late.tokens + prompt(llama, 4, seed=5), max_tokens=STEPS)  # late's slot kept its prefix
    run(engine, [nxt])
    assert engine.prefill_calls - calls == (0 if wait is None else 1)
    assert nxt.generated == single(llama, nxt.tokens)[0]


def test_newcomers_fed_together_take_their_prefixes_in_one_copy(model, monkeypatch):
    """Three newcomers arriving in one step while a row decodes, their prompts beginning with two
    different cached ones (20 and 26 tokens, two blocks of the prompt cache): their prefixes go
    into the batch in one insertion (a gather a block and layer), and each gets its one-request
    tokens."""
    from mlx_flashnorm.serve.slots import Slots

    a, b = prompt(model, 20, seed=21), prompt(model, 26, seed=22)
    engine = BatchEngine(model, prompt_cache=PromptCache(1 << 24))
    run(engine, [Request(a + prompt(model, 3, seed=23), max_tokens=2)])
    run(engine, [Request(b + prompt(model, 3, seed=24), max_tokens=2)])
    inserted = []
    monkeypatch.setattr(Slots, "insert", lambda self, requests, *rest, f=Slots.insert: inserted.append(
        len(requests)) or f(self, requests, *rest))
    running = Request(prompt(model, 6, seed=25), max_tokens=STEPS)
    engine.add(running)
    engine.step()
    late = [Request(p, 5) for p in (a + prompt(model, 4, seed=26), b + prompt(model, 6, seed=27),
                                    a + prompt(model, 2, seed=28))]
    for r in late:
        engine.add(r)
    calls = engine.prefill_calls
    while engine.busy:
        engine.step()
    assert [r.cached for r in late] == [20, 26, 20] and engine.prefill_calls == calls
    assert inserted[-1] == 3 and sum(inserted) == 4  # the running row, then the three together
    for r in late + [running]:
        assert r.generated == single(model, r.tokens, r.max_tokens)[0]


def a_row_left(engine, model, seed, lengths=(5, 10)):
    """(running, short): a request decoding and one of 2 tokens beside it, stepped until the short one
    has left the batch (its slot free, keeping what it read)."""
    running = Request(prompt(model, lengths[0], seed=seed), max_tokens=STEPS)
    short = Request(prompt(model, lengths[1], seed=seed + 1), 2)
    engine.add(running)
    engine.add(short)
    while short.slot is not None or not short.generated:
        engine.step()
    return running, short


def test_newcomer_reuses_the_free_slot_holding_its_prefix(model, monkeypatch):
    """A row leaves; a newcomer whose prompt begins with what that row read takes its slot with no
    copy (not through Slots.insert) and is fed only the rest, beside a newcomer with nothing
    cached that grows the batch (the resize carries the reused prefix); all get their one-request
    tokens."""
    engine = BatchEngine(model, prompt_cache=PromptCache(1 << 24))
    running, short = a_row_left(engine, model, 31, (9, 12))
    slot, kept = engine.slots.reuse(short.tokens + [0])
    assert slot is not None and engine.slots.rows[slot] is None and kept == len(short.tokens)
    inserted = inserted_requests(monkeypatch)
    late, other = Request(short.tokens + prompt(model, 5, seed=33), 6), Request(prompt(model, 4, seed=34), 5)
    before = engine.prefilled
    engine.add(late)
    engine.add(other)
    engine.step()
    assert late.cached >= len(short.tokens) and late not in inserted and other in inserted
    assert engine.slots.size == 4 and engine.prefilled - before == len(late.tokens) - late.cached + 4
    while engine.busy:
        engine.step()
    for r in (running, late, other):
        assert r.generated == single(model, r.tokens, r.max_tokens)[0]


@pytest.mark.parametrize("cache_bytes", [1 << 24, 1])
def test_idle_engine_keeps_its_slots_for_the_next_request(llama, monkeypatch, cache_bytes):
    """The batch's slots outlive an idle moment: the next request, its prompt beginning with the
    last one's, takes the slot that read it (no prefill call, no copy) and gets its one-request
    tokens; also where the prompt cache is too small to keep anything."""
    engine = BatchEngine(llama, prompt_cache=PromptCache(cache_bytes))
    first = Request(prompt(llama, 14, seed=41), max_tokens=3)
    run(engine, [first])
    inserted, calls = inserted_requests(monkeypatch), engine.prefill_calls
    nxt = Request(first.tokens + prompt(llama, 4, seed=42), max_tokens=STEPS)
    run(engine, [nxt])
    assert nxt.cached == len(first.tokens) and not inserted and engine.prefill_calls == calls
    assert nxt.generated == single(llama, nxt.tokens)[0]


def test_lone_newcomer_goes_solo_and_the_next_wave_finds_the_kept_slots(llama, monkeypatch):
    """After a wave, a lone request to the idle engine runs the one-request step at once; the wave's
    slots wait aside, and newcomers arriving while it decodes grow the batch into them (its row
    copied in) and take the slots holding their prefixes, with no copy of theirs; every request
    gets its one-request tokens."""
    system = prompt(llama, 12, seed=50)
    engine = BatchEngine(llama, prompt_cache=PromptCache(1 << 24))
    run(engine, [Request(system + prompt(llama, 3, seed=51 + i), max_tokens=2) for i in range(4)])
    assert engine.slots.size == 4 and not engine.rows
    lone = Request(system + prompt(llama, 4, seed=55), max_tokens=STEPS)
    engine.add(lone)
    engine.step()
    assert engine.solo and engine.spare is not None and lone.cached == len(system)
    inserted = inserted_requests(monkeypatch)
    wave = [Request(system + prompt(llama, 5, seed=56 + i), max_tokens=4) for i in range(3)]
    for r in wave:
        engine.add(r)
    engine.step()
    assert engine.slots.size == 4 and engine.spare is None and not inserted
    assert all(r.cached >= len(system) for r in wave)
    while engine.busy:
        engine.step()
    for r in wave + [lone]:
        assert r.generated == single(llama, r.tokens, r.max_tokens)[0]


def test_a_shrunk_batch_keeps_its_slots_aside_for_the_next_wave(llama, monkeypatch):
    """Where the rows fit a smaller bucket for SHRINK_AFTER steps they move into it and the larger slots
    wait aside, the slot a row ran in keeping nothing: a wave arriving later grows the batch back into
    them and takes the slots that kept its prefix, with no copy of theirs; every request gets its
    one-request tokens."""
    monkeypatch.setattr("mlx_flashnorm.serve.engine.SHRINK_AFTER", 2)
    system = prompt(llama, 12, seed=60)
    engine = BatchEngine(llama, prompt_cache=PromptCache(1 << 24))
    first = [Request(system + prompt(llama, 3, seed=61 + i), max_tokens=m) for i, m in enumerate((20, 2, 2, 2))]
    for r in first:
        engine.add(r)
    while engine.slots is None or engine.slots.size == 4:
        engine.step()
    long, spare = first[0], engine.spare
    assert engine.solo and spare is not None and spare.size == 4 and not any(spare.rows)
    assert sum(kept == () for kept in spare.left) == 1  # the long row's slot: it ran there
    assert all(kept[:len(system)] == tuple(system) for kept in spare.left if kept)
    inserted = inserted_requests(monkeypatch)
    wave = [Request(system + prompt(llama, 5, seed=66 + i), max_tokens=4) for i in range(3)]
    for r in wave:
        engine.add(r)
    engine.step()
    assert engine.slots is spare and engine.spare is None and not inserted
    assert all(r.cached >= len(system) for r in wave) and long in engine.rows
    while engine.busy:
        engine.step()
    for r in first + wave:
        assert r.generated == single(llama, r.tokens, r.max_tokens)[0]


def test_rows_leaving_while_others_decode_are_stored_once_the_engine_idles(llama, monkeypatch):
    """Rows that finish while others decode keep what they read in their slots; the prompt cache
    stores none of it until the engine idles, then all of it in one store."""
    engine = BatchEngine(llama, prompt_cache=PromptCache(1 << 24))
    rows = [Request(prompt(llama, 6 + i, seed=60 + i), max_tokens=2 + 3 * i) for i in range(3)]
    for r in rows:
        engine.add(r)
    engine.step()
    stores = []
    monkeypatch.setattr(PromptCache, "store_rows", lambda self, seqs, *rest, f=PromptCache.store_rows: stores.append(
        len(seqs)) or f(self, seqs, *rest))
    while rows[1].slot is not None or not rows[1].generated:
        engine.step()
    assert rows[2].slot is not None and not stores and len(engine.slots.unstored) == 2
    while engine.busy:
        engine.step()
    assert stores == [3] and not engine.slots.unstored
    for r in rows:
        read = r.tokens + r.generated
        assert engine.prompt_cache.fetch(read)[0] == len(read) - 1


def again_from_the_prompt_cache(engine, model, read):
    """A request reading `read` again, run with no kept slots (from the prompt cache): its tokens
    are its one-request tokens only if the stored keys and values are those of `read`."""
    engine.slots = engine.spare = None
    again = Request(read + prompt(model, 2, seed=79), max_tokens=4)
    run(engine, [again])
    assert again.cached == len(read) and again.generated == single(model, again.tokens, 4)[0]


def test_a_kept_slot_is_stored_before_a_newcomer_takes_it(llama):
    """A newcomer sharing the start of what a free slot kept takes that slot (fed the rest, which
    writes over the rest of it): the slot's tokens go to the prompt cache first, as they were."""
    engine = BatchEngine(llama, prompt_cache=PromptCache(1 << 24))
    _, short = a_row_left(engine, llama, 70)
    read = (short.tokens + short.generated)[:-1]
    assert engine.slots.unstored and engine.prompt_cache.fetch(read + [0])[0] < len(read)
    late = Request(short.tokens[:6] + prompt(llama, 3, seed=72), max_tokens=4)
    engine.add(late)
    engine.step()
    assert late.cached == 6 and late.slot is not None and not engine.slots.unstored
    assert engine.prompt_cache.fetch(read + [0])[0] == len(read)
    while engine.busy:
        engine.step()
    assert late.generated == single(llama, late.tokens, 4)[0]
    again_from_the_prompt_cache(engine, llama, read)


def test_a_kept_slot_is_stored_before_a_prefilled_newcomer_is_put_in_it(llama):
    """A prefilled newcomer sharing nothing with a free slot's tokens is put in it (Slots.insert):
    the slot's tokens go to the prompt cache first, as they were."""
    engine = BatchEngine(llama, prompt_cache=PromptCache(1 << 24), feed=0)
    _, short = a_row_left(engine, llama, 74)
    slot, read = next(iter(engine.slots.unstored.items()))
    assert engine.prompt_cache.fetch(read + [0])[0] < len(read)
    late = Request(prompt(llama, 7, seed=76), max_tokens=4)
    engine.add(late)
    engine.step()
    assert late.slot == slot and not engine.slots.unstored
    assert engine.prompt_cache.fetch(read + [0])[0] == len(read)
    while engine.busy:
        engine.step()
    assert late.generated == single(llama, late.tokens, 4)[0]
    again_from_the_prompt_cache(engine, llama, list(read))


def test_a_newcomer_too_long_to_feed_finds_a_kept_slots_tokens_in_the_prompt_cache(llama):
    """A newcomer sharing the start of what a free slot kept, with more left than the engine feeds,
    is prefilled from the prompt cache: the slot's tokens are stored first, so it is prefilled from
    them, not from scratch, and gets its one-request tokens."""
    engine = BatchEngine(llama, prompt_cache=PromptCache(1 << 24), feed=4)
    _, short = a_row_left(engine, llama, 77)
    late = Request(short.tokens[:9] + prompt(llama, 8, seed=80), max_tokens=4)
    engine.add(late)
    engine.step()
    assert late.cached == 9 and not engine.slots.unstored
    while engine.busy:
        engine.step()
    assert late.generated == single(llama, late.tokens, 4)[0]


def test_kept_slots_are_stored_before_the_batch_is_rebuilt(llama):
    """Slots that kept rows' tokens are stored before their Slots is resized (the batch grows), made
    anew (rows cancelled as a larger wave comes) or left (the lone row's slots, as the batch grows
    into the wave's): what they read is in the prompt cache, as it was."""
    engine = BatchEngine(llama, prompt_cache=PromptCache(1 << 24))  # resized: 2 -> 4 slots
    _, short = a_row_left(engine, llama, 81)
    read = (short.tokens + short.generated)[:-1]
    for i in range(2):
        engine.add(Request(prompt(llama, 6, seed=83 + i), max_tokens=3))
    engine.step()
    assert engine.slots.size == 4 and engine.prompt_cache.fetch(read + [0])[0] == len(read)
    while engine.busy:
        engine.step()
    again_from_the_prompt_cache(engine, llama, read)

    engine = BatchEngine(llama, prompt_cache=PromptCache(1 << 24))  # made anew: rows cancelled, 4 come
    rows = [Request(prompt(llama, 5 + i, seed=85 + i), max_tokens=STEPS) for i in range(2)]
    for r in rows:
        engine.add(r)
    for _ in range(3):
        engine.step()
    for r in rows:
        r.cancelled = True
    for i in range(4):
        engine.add(Request(prompt(llama, 6, seed=87 + i), max_tokens=3))
    engine.step()
    for r in rows:
        read = (r.tokens + r.generated)[:-1]
        assert engine.prompt_cache.fetch(read + [0])[0] == len(read)

    engine = BatchEngine(llama, prompt_cache=PromptCache(1 << 24))  # the lone row's slots left
    run(engine, [Request(prompt(llama, 8, seed=91 + i), max_tokens=2) for i in range(4)])
    lone = Request(prompt(llama, 9, seed=95), max_tokens=STEPS)
    engine.add(lone)
    for _ in range(3):
        engine.step()
    assert engine.solo and engine.spare is not None
    lone.cancelled = True
    for i in range(2):
        engine.add(Request(prompt(llama, 6, seed=96 + i), max_tokens=3))
    engine.step()
    read = (lone.tokens + lone.generated)[:-1]
    assert engine.spare is None and engine.prompt_cache.fetch(read + [0])[0] == len(read)

    engine = BatchEngine(llama, prompt_cache=PromptCache(1 << 24))  # the spare's slots, grown into
    wave = [Request(prompt(llama, 8, seed=101 + i), max_tokens=STEPS) for i in range(4)]
    for r in wave:
        engine.add(r)
    for _ in range(3):
        engine.step()
    for r in wave:  # leaving as a lone request comes: the slots, with what they kept, are set aside
        r.cancelled = True
    engine.add(Request(prompt(llama, 9, seed=105), max_tokens=STEPS))
    engine.step()
    assert engine.solo and engine.spare is not None
    for i in range(3):
        engine.add(Request(prompt(llama, 6, seed=106 + i), max_tokens=3))
    engine.step()
    assert engine.spare is None
    while engine.busy:
        engine.step()
    for r in wave:
        again_from_the_prompt_cache(engine, llama, (r.tokens + r.generated)[:-1])


def test_row_cancelled_while_fed_keeps_only_what_it_read(llama):
    """A fed newcomer cancelled before its prompt is in: the prompt cache keeps the positions it
    wrote, no more, and a request with its prompt later gets its one-request tokens from them."""
    engine = BatchEngine(llama, prompt_cache=PromptCache(1 << 24))
    running, fed = Request(prompt(llama, 5, seed=1), max_tokens=STEPS), Request(prompt(llama, 25, seed=2), 4)
    engine.add(running)
    engine.step()
    engine.add(fed)
    for _ in range(6):
        engine.step()
    fed.cancelled = True
    while engine.busy:
        engine.step()
    n, kv = engine.prompt_cache.fetch(fed.tokens)
    assert 0 < n < 24 and kv[0][0].shape[2] == n
    again = Request(fed.tokens, 4)
    run(engine, [again])
    assert again.cached == n and again.generated == single(llama, fed.tokens, 4)[0]


def test_newcomer_left_over_waits_to_be_prefilled_whole(model):
    """Six newcomers of 9 prompt tokens to prefill, a budget that holds five and 4 tokens more: the
    sixth is not begun beside the five's call (it would go on alone), so two calls in all."""
    requests = [Request(prompt(model, 10, seed=60 + i), max_tokens=3) for i in range(6)]
    engine = BatchEngine(model, prefill_step=5 * 9 + 4)
    run(engine, requests)
    assert engine.prefill_calls == 2 and engine.prefilled == 60
    assert requests[5].generated == single(model, requests[5].tokens, steps=3)[0]


def test_rows_share_steps(model):
    """The batch really decodes together: 3 requests of 12 tokens take 12 decode steps + joins,
    not 36."""
    requests = [Request(prompt(model, n), max_tokens=STEPS) for n in (4, 6, 9)]
    engine = BatchEngine(model)
    for r in requests:
        engine.add(r)
    steps = 0
    while engine.busy:
        engine.step()
        steps += 1
    assert steps == STEPS


def test_prompt_cache_skips_shared_prefix(model):
    """A shared system prompt is prefilled once; a conversation's next turn prefills only its new
    tokens; the outputs equal the uncached ones."""
    system = prompt(model, 20, seed=1)
    a, b = system + prompt(model, 6, seed=2), system + prompt(model, 7, seed=3)
    assert a[20] != b[20]
    engine = BatchEngine(model, prompt_cache=PromptCache(1 << 24))
    first = Request(a, max_tokens=STEPS)
    run(engine, [first])
    assert engine.prefilled == len(a) and first.cached == 0
    second = Request(b, max_tokens=STEPS)
    run(engine, [second])
    assert second.cached == 20 and engine.prefilled == len(a) + len(b) - 20
    assert second.generated == single(model, b)[0]
    turn = a + first.generated + prompt(model, 5, seed=4)  # the reply, then the user's next message
    third = Request(turn, max_tokens=STEPS)
    before = engine.prefilled
    run(engine, [third])
    assert third.cached == len(a) + STEPS - 1  # the last token sampled was never fed
    assert engine.prefilled - before == len(turn) - third.cached == 6
    assert third.generated == single(model, turn)[0]
    again = Request(a, max_tokens=STEPS)  # all but its last token cached: it joins the batch at once
    before = engine.prefilled
    run(engine, [again])
    assert again.cached == len(a) - 1 and engine.prefilled - before == 1 and again.generated == first.generated


def test_seeded_sampling_equals_single(model):
    """Seeded sampled requests in a batch (beside a greedy one) draw what they draw alone: the
    lone sampler, seeded with mx.random.seed, draws the batch's tokens from the batch's own
    log-probabilities (exact on any device), and the lone request's tokens are the batch's for
    as long as its log-probabilities are the batch's to the bit (on a GPU the padded prefill sums
    in another order, ~1e-6, and a draw near a boundary may part there: 2026-11-26, H100)."""
    prompts = [prompt(model, n) for n in (6, 11, 3)]
    sampling = [dict(temp=1.0, top_k=50), dict(temp=0.8, top_p=0.9)]
    requests = [Request(prompts[0], STEPS, seed=5, **sampling[0]),
                Request(prompts[1], STEPS, seed=9, **sampling[1]), Request(prompts[2], STEPS)]
    events = run(BatchEngine(model), requests)
    for r, ev, seed, kw in zip(requests, events, (5, 9), sampling):
        mx.random.seed(seed)
        sampler = Request(r.tokens, **kw).sampler
        assert [sampler(e.logprobs[None]).item() for e in ev] == r.generated
        mx.random.seed(seed)
        alone = list(generate_step(mx.array(r.tokens), model, max_tokens=STEPS,
                                   sampler=Request(r.tokens, **kw).sampler))
        same = next((i for i, ((_, lp), e) in enumerate(zip(alone, ev)) if not mx.array_equal(lp, e.logprobs)), STEPS)
        assert [t for t, _ in alone][:same] == r.generated[:same]
        if mx.default_device() == mx.cpu:  # the CPU's batch sums alike: the whole sequence
            assert same == STEPS
    assert requests[0].generated != requests[1].generated


@pytest.fixture(scope="module")
def llama():
    return random_model(dict(TINY_LLAMA, max_position_embeddings=256), "flash")


def test_prompt_cache_lru_bound(llama):
    """Entries are evicted least recently used first; the bytes held stay within the bound; an
    entry that begins another is dropped for it."""
    engine = BatchEngine(llama, prompt_cache=PromptCache(1 << 24))
    run(engine, [Request(prompt(llama, 30, seed=s), max_tokens=2) for s in (1, 2)])
    size = engine.prompt_cache.nbytes // 2  # one entry of 30 + 1 positions
    cache = engine.prompt_cache = PromptCache(2 * size + size // 2)  # room for two
    for s in (1, 2, 3):
        run(engine, [Request(prompt(llama, 30, seed=s), max_tokens=2)])
    assert len(cache) == 2 and cache.nbytes <= cache.max_bytes
    assert cache.fetch(prompt(llama, 30, seed=1))[0] == 0  # the oldest went
    assert cache.fetch(prompt(llama, 30, seed=3))[0] == 29
    assert PromptCache(0).fetch([1, 2, 3]) == (0, None)


def test_prompt_cache_finds_the_longest_prefix_among_its_entries():
    """A lookup takes the entry sharing the most leading tokens (at most all but the prompt's
    last); a stored sequence supersedes the entries it begins with and is not kept where an entry
    begins with it."""
    def kv(n):
        return [(mx.full((1, 1, n, 2), float(n)), mx.zeros((1, 1, n, 2)))]

    cache = PromptCache(1 << 20)
    for seq in ([1, 2, 3, 4], [1, 2, 9], [5, 6], [1, 2, 3, 4, 5, 6, 7]):  # the last supersedes the first
        cache.store(seq, kv(len(seq)))
    assert len(cache) == 3
    n, got = cache.fetch([1, 2, 3, 4, 5, 8])
    assert n == 5 and got[0][0].shape[2] == 5 and got[0][0][0, 0, 0, 0].item() == 7  # the 7-token entry's
    assert cache.fetch([1, 2, 9])[0] == 2 and cache.fetch([1, 2, 9, 4])[0] == 3 and cache.fetch([7, 1]) == (0, None)
    cache.store([1, 2, 3], kv(3))  # an entry begins with it
    assert len(cache) == 3
    cache.store([5, 6, 1], kv(3))  # it begins with [5, 6]
    assert len(cache) == 3 and cache.fetch([5, 6, 1, 0])[0] == 3 and cache.fetch([5, 6, 2])[0] == 2


def test_prompt_cache_lookup_after_entries_are_reordered():
    """A lookup finds the entry it matches after others were used (reordered least recently used
    first), stored and dropped: the lookup's table and its keys stay in one order."""
    def kv(mark, n):
        return [(mx.full((1, 1, n, 2), float(mark)), mx.zeros((1, 1, n, 2)))]

    cache = PromptCache(1 << 20)
    cache.store([1, 2, 3], kv(1, 3))
    cache.store([4, 5, 6], kv(2, 3))
    cache.store([7, 8], kv(3, 2))
    assert cache.fetch([1, 2, 3, 0])[0] == 3  # now the most recent
    cache.store([9, 9, 9], kv(4, 3))
    cache.store([7, 8, 1], kv(5, 3))  # supersedes [7, 8]
    for tokens, mark in (([4, 5, 6, 0], 2), ([1, 2, 3, 0], 1), ([9, 9, 9, 0], 4), ([7, 8, 1, 0], 5)):
        n, got = cache.fetch(tokens)
        assert n == 3 and got[0][0][0, 0, 0, 0].item() == mark


def test_prompt_cache_rows_stored_together_share_one_copy():
    """store_rows copies the rows out in one gather per layer; their entries hold the block, whose
    bytes count once, until its last entry goes."""
    keys = mx.arange(3 * 6 * 2, dtype=mx.float32).reshape(3, 1, 6, 2)
    cache = PromptCache(1 << 20)
    cache.store_rows([[1, 2, 3], [4, 5, 6, 7, 8], [9, 1]], [(keys, -keys)], [2, 0, 1])
    block = 2 * 3 * 5 * 2 * 4  # keys and values, 3 rows of the longest's 5 positions, float32
    assert len(cache) == 3 and cache.nbytes == block
    n, got = cache.fetch([4, 5, 6, 7, 8, 0])
    assert n == 5 and mx.array_equal(got[0][0], keys[0:1, :, :5]).item()
    assert mx.array_equal(got[0][1], -keys[0:1, :, :5]).item()
    n, got = cache.fetch([1, 2, 3, 0])
    assert n == 3 and mx.array_equal(got[0][0], keys[2:3, :, :3]).item()

    def one(n):  # one row's entry of n positions
        return [(keys[:1, :, :n], keys[:1, :, :n])]

    cache.store([1, 2, 3, 4], one(4))  # supersedes [1, 2, 3]: the block is still held by two
    cache.store([9, 1, 2], one(3))
    assert len(cache) == 3 and cache.nbytes == block + 2 * 4 * 2 * 4 + 2 * 3 * 2 * 4
    cache.store([4, 5, 6, 7, 8, 1], one(6))  # the block's last entry goes
    assert len(cache) == 3 and cache.nbytes == 2 * (4 + 3 + 6) * 2 * 4


def test_prompt_cache_rows_stored_together_keep_the_latest_that_fit():
    """Rows stored together whose one copy would pass the bound: the last of them that fit are
    kept (a batch's rows stored at once when the engine idles), not none."""
    keys = mx.arange(3 * 6 * 2, dtype=mx.float32).reshape(3, 1, 6, 2)
    cache = PromptCache(2 * 5 * 16)  # two rows of 5 positions (8 bytes of keys and 8 of values each)
    cache.store_rows([[1, 2, 3], [4, 5, 6, 7, 8], [9, 1]], [(keys, -keys)], [2, 0, 1])
    assert len(cache) == 2 and cache.nbytes == 2 * 5 * 16
    assert cache.fetch([1, 2, 3, 0])[0] == 0 and cache.fetch([9, 1, 0])[0] == 2
    n, got = cache.fetch([4, 5, 6, 7, 8, 0])
    assert n == 5 and mx.array_equal(got[0][0], keys[0:1, :, :5]).item()


def test_cancel_and_context(llama):
    """A cancelled request leaves at the next step while the others go on; max_tokens is cut to
    the context; a prompt that fills the context is refused."""
    a, b = Request(prompt(llama, 5), max_tokens=STEPS), Request(prompt(llama, 7), max_tokens=STEPS)
    engine = BatchEngine(llama)
    engine.add(a)
    engine.add(b)
    engine.step()
    a.cancelled = True
    events = []
    while engine.busy:
        events += engine.step()
    assert {e.request for e in events} == {b} and len(a.generated) == 1 and len(b.generated) == STEPS
    long = Request(prompt(llama, 250), max_tokens=100)
    engine.add(long)
    assert long.max_tokens == 6
    with pytest.raises(ValueError, match="context"):
        engine.add(Request(prompt(llama, 256)))


def test_batch_worker_serves_tickets_concurrently(llama):
    """BatchWorker (the server's worker): tickets submitted from several threads at once get their
    single-request tokens, log-probabilities where asked; a cancelled ticket's request leaves the
    batch; a stop token ends a request with finish "stop"."""
    prompts = [prompt(llama, n) for n in (3, 8, 13, 21)]
    reference = [single(llama, p) for p in prompts]
    stop = reference[2][0][5]  # the third request's sixth token ends it
    worker = BatchWorker(llama, SimpleNamespace(eos_token_ids={stop}), prompt_cache_bytes=1 << 20)
    results = [None] * len(prompts)

    def client(i):
        ticket = worker.submit(Generation(prompts[i], STEPS, top_logprobs=2 if i == 1 else None))
        results[i] = list(iter(lambda: ticket.next(timeout=120), None))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    cancelled = worker.submit(Generation(prompts[0], 200))
    first = cancelled.next(timeout=120)
    cancelled.cancel()
    for t in threads:
        t.join(timeout=120)
    for i, (tokens, _) in enumerate(reference):
        want = tokens[:tokens.index(stop) + 1] if i == 2 else tokens
        assert [t.id for t in results[i]] == want
        assert [t.finish_reason for t in results[i]][-1] == ("stop" if i == 2 else "length")
    for t, row in zip(results[1], reference[1][1]):
        assert abs(t.logprob - row[t.id].item()) < f32_tol(TOL) and t.top_logprobs[0][0] == t.id
    assert first.id == reference[0][0][0]
    deadline = time.monotonic() + 60
    while worker.engine.busy:  # the cancelled request leaves at the next step
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert len(worker.engine.prompt_cache) > 0


def test_batch_worker_gathers_a_burst_into_one_prefill_call(llama):
    """Tickets of a burst (their requests followed by others at the server: Generation.followed)
    that reach an idle BatchWorker one after another, each within its gather gap of the last, are
    prefilled in one shared call (not the first alone and the rest behind it), and each still gets
    its single-request tokens."""
    prompts = [prompt(llama, n, seed=n) for n in (5, 7, 9, 11)]
    worker = BatchWorker(llama, SimpleNamespace(eos_token_ids=set()), gather=(1.0, 10.0))
    tickets = []
    for p in prompts:
        tickets.append(worker.submit(Generation(p, STEPS, followed=True)))
        time.sleep(0.05)
    results = [[t.id for t in iter(lambda: ticket.next(timeout=120), None)] for ticket in tickets]
    assert worker.engine.prefill_calls == 1
    assert results == [single(llama, p)[0] for p in prompts]


def test_a_lone_request_waits_for_no_burst(llama):
    """A ticket whose request came alone (not followed) starts at once at an idle worker whose
    gather gap is 300 s: answered well within it (a bound, not a pace), its single-request
    tokens."""
    p = prompt(llama, 6, seed=3)
    worker = BatchWorker(llama, SimpleNamespace(eos_token_ids=set()), gather=(300.0, 600.0))
    began = time.monotonic()
    ticket = worker.submit(Generation(p, STEPS))
    tokens = [t.id for t in iter(lambda: ticket.next(timeout=600), None)]
    assert time.monotonic() - began < 150 and tokens == single(llama, p)[0]


def test_warmup_leaves_no_trace(llama, monkeypatch):
    """warmup() runs the model (a shared prefill call among its calls, newcomers fed whatever the
    engine's feed_wait) but leaves the prompt cache, the counts, the bound, no measured step periods
    and the batch as they were."""
    engine = BatchEngine(llama, prompt_cache=PromptCache(1 << 24), feed_wait=1e-9)  # (no bound in the warm-up)
    from mlx_flashnorm.serve.slots import Slots

    calls, fed, inserted = [], [], []
    monkeypatch.setattr(Slots, "insert", lambda *a, f=Slots.insert: inserted.append(f(*a)) or inserted[-1])
    moved = []
    monkeypatch.setattr(Slots, "moved", lambda self, into, f=Slots.moved: moved.append(into.size) or f(self, into))
    engine._prefill_together = lambda f=engine._prefill_together: calls.append(f()) or calls[-1]
    engine._feed = lambda newcomers, f=engine._feed: fed.append([r.cached for r, _, _ in newcomers]) or f(newcomers)
    warmup(engine)
    assert any(calls) and (engine.prefilled, engine.prefill_calls) == (0, 0)
    assert [16, 16] in fed and [1, 3] in inserted  # two newcomers fed beside running rows, cached prefixes, slots apart
    assert moved == [4]  # a lone request's batch grown into the slots set aside
    assert len(engine.prompt_cache) == 0 and not engine.busy and engine.feed_wait == 1e-9 and not engine.periods
    r = Request(prompt(llama, 9), max_tokens=STEPS)
    run(engine, [r])
    assert r.generated == single(llama, r.tokens)[0] and (engine.prefilled, engine.prefill_calls) == (9, 1)


def test_logits_processors_per_row(llama):
    """A row's logits processors, given its tokens so far, change its tokens only: alone or beside
    others (one without any), it gets the same tokens; the other rows get their single tokens."""
    def odd_unseen(tokens, logits):  # bans even ids and every id seen so far (prompt and output)
        ids = mx.arange(logits.shape[-1])
        banned = (ids % 2 == 0) | (ids[:, None] == tokens[None]).any(axis=1)
        return mx.where(banned, -mx.inf, logits)

    p, q = prompt(llama, 7), prompt(llama, 12)
    alone = Request(p, max_tokens=STEPS, logits_processors=[odd_unseen])
    run(BatchEngine(llama), [alone])
    together = [Request(p, max_tokens=STEPS, logits_processors=[odd_unseen]), Request(q, max_tokens=STEPS),
                Request(p, max_tokens=STEPS)]
    run(BatchEngine(llama), together)
    out = alone.generated
    assert all(t % 2 for t in out) and len(set(out + p)) == len(out) + len(set(p))
    assert together[0].generated == out != together[2].generated == single(llama, p)[0]
    assert together[1].generated == single(llama, q)[0]


def test_solo_row_takes_the_compiled_step_and_back(model, monkeypatch):
    """A lone row runs the compiled one-request step (Solo); a newcomer turns it back into a batch
    row, and when the other leaves the last row goes solo again (at once here: SHRINK_AFTER 0);
    tokens stay the single ones."""
    monkeypatch.setattr("mlx_flashnorm.serve.engine.SHRINK_AFTER", 0)
    a, b = prompt(model, 9), prompt(model, 14)
    first, second = Request(a, max_tokens=STEPS), Request(b, max_tokens=4)
    engine = BatchEngine(model)
    engine.add(first)
    modes = []
    while len(modes) <= 3 or engine.busy:
        if len(modes) == 3:
            engine.add(second)  # fed its prompt through the batch's steps, beside the first
        engine.step()
        modes.append("solo" if engine.solo else len(engine.rows))
    assert modes[:3] == ["solo"] * 3 and 2 in modes and modes[-2] == "solo" and modes[-1] == 0
    assert first.generated == single(model, a)[0] and second.generated == single(model, b, 4)[0]
    lone = Request(prompt(model, 1), max_tokens=4)  # nothing cached before its first step
    run(engine, [lone])
    assert lone.generated == single(model, lone.tokens, 4)[0]


def test_batch_keeps_its_bucket_between_waves(llama):
    """Rows leaving for fewer than SHRINK_AFTER steps do not shrink the batch: a newcomer that comes
    within them finds the 4 slots, with no copy of the remaining row's cache; left alone longer, the
    last row goes solo."""
    engine = BatchEngine(llama)
    first = [Request(prompt(llama, 4 + i, seed=70 + i), max_tokens=m) for i, m in enumerate((80, 3, 3))]
    for r in first:
        engine.add(r)
    sizes = []
    late = Request(prompt(llama, 5, seed=80), max_tokens=4)
    while engine.busy:
        if len(sizes) == 8:
            engine.add(late)
        engine.step()
        sizes.append(engine.slots.size if engine.slots else 0)
    assert sizes[:8 + 8] == [4] * 16 and sizes.index(1) > 8 + SHRINK_AFTER and sizes[-1] == 1
    assert late.generated == single(llama, late.tokens, 4)[0]
    assert first[0].generated == single(llama, first[0].tokens, 80)[0]


@pytest.fixture(scope="module")
def small_vocab():
    """The tiny Llama with a vocabulary of 512: a step of 64 rows takes milliseconds on the CPU (its
    LM head over SmolLM2's 49,152 ids took most of a second)."""
    return random_model(dict(TINY_LLAMA, vocab_size=512, max_position_embeddings=256), "flash")


def test_batched_greedy_equals_single_at_64_rows(small_vocab):
    """64 rows: 56 requests at step 0, 8 joining at step 2 while the others decode (fed their
    prompts), all 64 decoding together, rows leaving from step 3 on (max_tokens 3 to 12) and 16
    more arriving at step 5, who wait for the rows that leave (max_batch 64). Each request gets its
    one-request tokens and log-probabilities. Then the same requests under a KV budget of 16 rows:
    at most 16 decode together (the slots, and those set aside, within the budget at every step),
    the others wait, and every request's tokens are the same."""
    from mlx_flashnorm.serve.slots import kv_layout, token_bytes

    model = small_vocab
    n = 80
    prompts = [prompt(model, 1 + (7 * i) % 29, seed=300 + i) for i in range(n)]
    lengths = [4 + (7 * i) % 9 for i in range(n)]
    joins = [0] * 56 + [2] * 8 + [5] * 16
    reference = [single(model, p, m) for p, m in zip(prompts, lengths)]

    def play(engine):
        requests, rows = [Request(p, max_tokens=m) for p, m in zip(prompts, lengths)], []

        def held():
            rows.append(len(engine.rows))
            held = engine.slots.nbytes + (engine.spare.nbytes if engine.spare is not None else 0)
            assert engine.kv_budget is None or held <= engine.kv_budget

        for r, (tokens, lp), ev in zip(requests, reference, run(engine, requests, joins, held)):
            assert [e.token for e in ev] == r.generated == tokens
            got = mx.stack([e.logprobs for e in ev])
            assert mx.allclose(got, lp, rtol=f32_tol(TOL), atol=f32_tol(TOL)).item()
        return rows

    rows = play(BatchEngine(model, max_batch=64))
    assert max(rows) == 64 and rows.index(64) < 5 and 0 < min(rows[5:-1])
    row_bytes = cache_capacity(model, max(len(p) + m for p, m in zip(prompts, lengths))) * token_bytes(
        kv_layout(model))
    rows = play(BatchEngine(model, max_batch=64, kv_budget=16 * row_bytes))
    assert max(rows) == 16


def test_a_burst_prefilled_over_several_steps_grows_the_batch_once(small_vocab, monkeypatch):
    """20 newcomers whose prompts take 5 steps' prefill budgets: the batch is made once, for all of
    them (32 slots), and the later ones join it in free slots; no live row is copied into new
    buffers (Slots.resized, Slots.moved)."""
    from mlx_flashnorm.serve.slots import Slots

    copies = []
    monkeypatch.setattr(Slots, "resized", lambda self, *a, f=Slots.resized: copies.append(a) or f(self, *a))
    monkeypatch.setattr(Slots, "moved", lambda self, into, f=Slots.moved: copies.append(into) or f(self, into))
    requests = [Request(prompt(small_vocab, 10, seed=400 + i), max_tokens=6) for i in range(20)]
    engine = BatchEngine(small_vocab, prefill_step=40)
    for r in requests:
        engine.add(r)
    made, joined = [], []
    while engine.busy:
        engine.step()
        made.append(engine.slots)
        joined.append(len(engine.rows))
    assert len(set(map(id, made))) == 1 and made[0].size == 32 and copies == []
    assert joined[0] < 20 and max(joined) == 20  # (they joined over several steps)
    assert engine.prefill_calls >= 5
    for r in requests[::5]:
        assert r.generated == single(small_vocab, r.tokens, 6)[0]
