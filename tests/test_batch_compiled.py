"""The continuous batch's compiled step (batch_cache): buckets of slots and capacity, rows joining
and leaving without a new trace, idle slots that change nothing, and the pipelined engine."""
import importlib

import mlx.core as mx
import pytest

from mlx_flashnorm.serve.engine import BatchEngine
from mlx_flashnorm.serve.sequence import Request
from mlx_flashnorm.serve.slots import Slots, bucket, kv_layout

from conftest import GEMMA3, TINY_LLAMA, count_traces, random_model
from test_batch import prompt, single

generate = importlib.import_module("mlx_flashnorm.decoding")  # the module (the package exports a function of its name)

# (config, bits): Gemma 3's of head size 64, 4-bit, is a stack the whole-step kernels take (on CUDA
# the batch's steps run decode_rows, a lone row decode_layers: batched tokens equal single tokens
# through them)
CONFIGS = {"llama": (TINY_LLAMA, None), "gemma3": (dict(GEMMA3, head_dim=64), 4)}


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    config, bits = CONFIGS[request.param]
    return random_model(dict(config, max_position_embeddings=256), "flash", bits)


def test_bucket():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 32, 33, 64, 65, 130)] == [1, 2, 4, 8, 8, 16, 32, 64, 64, 128, 192]


def test_buckets_grow_and_shrink(model, monkeypatch):
    """Rows joining grow the slots (1 -> 2 -> 8) and the capacity (a longer request), rows leaving
    shrink them (to a quarter, then one slot); every request gets its single tokens."""
    monkeypatch.setattr(generate, "CAPACITY_STEP", 16)  # capacity buckets of 16 positions
    monkeypatch.setattr("mlx_flashnorm.serve.engine.SHRINK_AFTER", 0)  # shrunk as soon as the rows fit
    lengths, steps = (5, 9, 3, 12, 7), (14, 4, 6, 30, 5)
    requests = [Request(prompt(model, n), max_tokens=m) for n, m in zip(lengths, steps)]
    joins = {0: [0], 1: [1], 3: [2, 3, 4]}
    engine = BatchEngine(model)
    shapes = []
    step = 0
    while step <= 3 or engine.busy:
        for i in joins.get(step, []):
            engine.add(requests[i])
        engine.step()
        if engine.slots is not None:
            shapes.append((engine.slots.size, engine.slots.capacity, len(engine.rows)))
        step += 1
    sizes = [s for s, _, _ in shapes]
    assert sizes[0] == 1 and 2 in sizes and 8 in sizes and sizes[-1] == 1
    assert sizes.index(8) < len(sizes) - 1 - sizes[::-1].index(2)  # back down to 2 after 8
    assert [c for _, c, _ in shapes][:2] == [32, 32] and max(c for _, c, _ in shapes) == 48  # 12 + 30 tokens
    assert all(rows <= size for size, _, rows in shapes)
    for r, m in zip(requests, steps):
        assert r.generated == single(model, r.tokens, m)[0]


def test_rows_join_and_leave_without_a_trace(model, monkeypatch):
    """Inside one bucket (4 slots), rows joining and leaving reuse the traced step (no trace after
    the first step, the lone last row's one-request step traced before); a slot freed by a row is
    taken by the next newcomer; a new bucket (8 slots) is traced once."""
    engine = BatchEngine(model)
    warm = [Request(prompt(model, n), max_tokens=3) for n in (4, 5, 6)]  # 3 rows: 4 slots
    late = [Request(prompt(model, n, seed=40 + n), max_tokens=m) for n, m in ((8, 6), (3, 4), (10, 5))]
    reference = [single(model, r.tokens, r.max_tokens)[0] for r in warm + late]
    for r in warm:
        engine.add(r)
    engine.step()
    traces = count_traces(model, monkeypatch)
    engine.add(late[0])
    slots = []
    while engine.busy:
        engine.step()
        slots.append([None if r is None else r.tokens[0] for r in engine.slots.rows] if engine.slots else None)
        if len(slots) == 2:
            engine.add(late[1])
            engine.add(late[2])
    assert traces == [] and not engine.busy
    assert any(s and late[1].tokens[0] in s and late[2].tokens[0] in s for s in slots)
    assert [r.generated for r in warm + late] == reference
    for n in range(5):
        engine.add(Request(prompt(model, 3 + n), max_tokens=4))
    while engine.busy:
        engine.step()
    assert len(traces) == 1


def test_idle_slots_change_nothing(model):
    """A row's log-probabilities in a bucket of 4 slots are the same whatever the idle slots hold
    (random keys, values and tokens), and an idle slot's position does not move."""
    layout = kv_layout(model)
    p = prompt(model, 9)
    cache = generate.make_cache(model)
    model(mx.array(p[:-1])[None], cache=cache)
    kv = [(c.keys[..., :c.offset, :], c.values[..., :c.offset, :]) for c in cache]
    outs = []
    for noise in (False, True):
        slots = Slots(model, layout, 4, 64)
        if noise:
            key = mx.random.key(3)
            slots.kv = [tuple(3 * mx.random.normal(b.shape, key=key).astype(b.dtype) for b in pair)
                        for pair in slots.kv]
            slots.tokens = mx.random.randint(0, model.args.vocab_size, (4,), key=key).astype(mx.uint32)
            slots.pos = [5, 0, 7, 2]
        slots.rows[0] = slots.rows[2] = object()  # two other slots were rows that left
        slots.release(0)
        slots.release(2)
        slots.insert(["row"], kv, [[p[-1]]], [kv[0][0].shape[2]])
        assert slots.rows.index("row") == 0
        step = [slots.decode()]
        slots.tokens = step[0][1]
        step.append(slots.decode())
        outs.append(mx.stack([out[0] for out, _ in step]))
        assert slots.pos == ([10, 0, 0, 0] if not noise else [10, 0, 7, 2])
        assert mx.array_equal(slots.offset, mx.array(slots.pos)).item()
    assert mx.array_equal(outs[0], outs[1]).item()
    tokens, logprobs = single(model, p, 2)
    assert mx.argmax(outs[0], axis=-1).tolist() == tokens
    assert mx.allclose(outs[0], logprobs, atol=1e-4, rtol=1e-4).item()


def test_pipelined_steps(model):
    """Each step() queues the next decode before reading the last: a stop token ends its row one
    step after it was queued (the extra token is dropped), the others go on; no step is queued
    past the last token a row may take."""
    a, b = prompt(model, 6), prompt(model, 11)
    reference = single(model, a)[0]
    stop = reference[3]
    first = Request(a, max_tokens=12, stop_tokens=frozenset({stop}))
    second = Request(b, max_tokens=7)
    engine = BatchEngine(model)
    engine.add(first)
    engine.add(second)
    events, queued = [], []
    while engine.busy:
        events += engine.step()
        queued.append(engine.pending is not None)
    assert first.generated == reference[:reference.index(stop) + 1]
    assert [e.finish_reason for e in events if e.request is first][-1] == "stop"
    assert second.generated == single(model, b, 7)[0] and len(events) == len(first.generated) + 7
    assert len(queued) == 7 and queued == [True] * 6 + [False]  # step 7 was second's last
    assert second.queued == 7 and first.queued == len(first.generated) + 1
