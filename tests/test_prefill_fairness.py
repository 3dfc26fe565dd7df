"""A long prompt does not hold everyone (issue 64): its prefill goes in chunks between the others'
prefills and decode steps, a short newcomer prefilled before its next chunk; the device is given
one chunk at a time, so a request cancelled (a client that hung up) stops within a chunk. Counted in
engine steps and chunks, never in time."""
import mlx.core as mx
import pytest

from mlx_flashnorm.serve import engine as engine_module
from mlx_flashnorm.serve.engine import BatchEngine
from mlx_flashnorm.serve.sequence import Request

from conftest import TINY_LLAMA, random_model

STEP = 8  # --prefill-step-size
LONG = 8 * STEP + 1  # the long prompt: eight chunks and its last token


@pytest.fixture(scope="module")
def llama():
    return random_model(dict(TINY_LLAMA, max_position_embeddings=256), "rms")


def prompt(model, n, seed):
    return mx.random.randint(0, model.args.vocab_size, (n,), key=mx.random.key(seed)).tolist()


def first_token_step(engine, request, limit=100):
    """Step engine until request has its first token; the step's number (from 1)."""
    for step in range(1, limit):
        engine.step()
        if request.generated:
            return step
    raise AssertionError("no first token")


@pytest.mark.parametrize("decoding", [False, True])
def test_a_short_newcomer_is_prefilled_before_a_long_prompts_next_chunk(llama, decoding):
    """A long prompt under prefill, one chunk done; a 3-token newcomer (too long to feed: feed 0, as
    where steps are slow) gets its first token at the next step, while the long prompt still has
    chunks to go (the rest of the step's budget went to it); the long one then finishes its prefill.
    decoding: a request decodes beside them."""
    engine = BatchEngine(llama, prefill_step=STEP, feed=0)
    if decoding:
        engine.add(Request(prompt(llama, 4, 1), max_tokens=200))
        first_token_step(engine, engine.waiting[0])
    long = Request(prompt(llama, LONG, 2), max_tokens=2)
    engine.add(long)
    engine.step()
    assert [len(f.todo) for f in engine.filling] == [LONG - 1 - STEP]
    short = Request(prompt(llama, 3, 3), max_tokens=2)
    engine.add(short)
    # (at the next step; rows decoding, the one after: the step queued before it joined goes first)
    assert first_token_step(engine, short) == 1 + decoding
    assert [len(f.todo) for f in engine.filling] == [LONG - 1 - (2 + decoding) * STEP + 2]
    while not long.generated:
        engine.step()
    assert engine.prefilled >= LONG + 3


def test_a_chunk_is_waited_for_before_the_next_is_queued(llama, monkeypatch):
    """With no row decoding, step() returns as soon as a chunk is queued (mx.async_eval): without a
    wait, every chunk of a long prompt would be on the device within microseconds, and a newcomer or
    a cancel would come after them all. Here a step that queues a chunk waits (mx.eval) before it
    returns for the chunk queued by the step before: one chunk on the device at a time."""
    log = []
    real = engine_module.mx

    class Device:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def eval(*arrays):
            log.append("wait")
            return real.eval(*arrays)

    monkeypatch.setattr(engine_module, "mx", Device())
    call = type(llama).__call__
    monkeypatch.setattr(type(llama), "__call__",
                        lambda self, *a, **k: log.append("chunk") or call(self, *a, **k))
    engine = BatchEngine(llama, prefill_step=STEP, feed=0)
    engine.add(Request(prompt(llama, LONG, 2), max_tokens=2))
    engine.step()
    for step in range(1, 5):
        log.clear()
        engine.step()
        assert log == ["chunk", "wait"], f"step {step}: {log}"


def test_a_cancelled_long_prompt_stops_at_the_next_chunk(llama):
    """A long prompt cancelled after its first chunk: no further chunk runs, and a request after it
    is served at once."""
    engine = BatchEngine(llama, prefill_step=STEP, feed=0)
    long = Request(prompt(llama, LONG, 2), max_tokens=2)
    engine.add(long)
    engine.step()
    calls, prefilled = engine.prefill_calls, engine.prefilled
    long.cancelled = True
    other = Request(prompt(llama, 5, 4), max_tokens=1)
    engine.add(other)
    assert first_token_step(engine, other) == 1
    assert engine.prefill_calls == calls + 1 and engine.prefilled == prefilled + 5
    assert not engine.busy and not long.generated


def tree(arrays):
    for a in arrays:
        if isinstance(a, (list, tuple)):
            yield from tree(a)
        elif isinstance(a, dict):
            yield from tree(list(a.values()))
        else:
            yield a
