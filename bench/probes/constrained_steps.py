"""Where the host time of BatchEngine.step goes with rows under a grammar (constrained decoding)
beside free rows: each step's time split into its phases, per case of 32 concurrent clients.

    PYTHONPATH=$PWD python bench/probes/constrained_steps.py [--model tiny|smollm2]
        [--cases free,spread,half,all] [--clients 32] [--steps 300] [--warm 40] [--rounds 1]
        [--schema person|story] [--feed-wait] [--ab]

It drives a BatchEngine directly (no HTTP), set up as bench.serve's in-process engine (the
server's prompt cache, kv budget and warm-up; its feed_wait only with --feed-wait: this CPU's slow
steps would prefill every newcomer that a GPU's feed), with the embedded SmolLM2's tokenizer
and chat template: each client sends a chat request (bench.load's prompts), and the next one as
soon as its answer ended, so the batch stays full. The cases: `free` (every answer max_tokens
long), `spread` (free answers of random lengths between --short and --long tokens: rows leave and
join as constrained ones do), `half` (the first half of the clients ask for a JSON schema's
answer, the rest free, max_tokens long), `all` (every client asks for it). Greedy. The schema:
--schema person (the default: tests/test_structured.py's) or story (bench.load's).
--model tiny (the default) is a random Llama of two small layers over SmolLM2's vocabulary (its
device work small, so the host's shows); smollm2 the embedded model itself (seconds a step here).

Each step's time (perf_counter) is split into: build (the constraints of the requests added
since the last step: the batch worker builds them on the engine's thread, before its step),
prefill (BatchEngine._prefill), place (_place), queue (runner.queue_step: the step's graph and the
compiled call; rebuilds of the slots' inputs counted apart), eval (mx.async_eval: on this CPU it
waits for the step before, so the device's time shows here), wait (the queued step's tokens and
the draws evaluated before _read: with hold off, the masks' wait too), read (_read past the wait),
draw (runner.Draws.draw: the masked rows' draws, and with hold off the wait for their masks,
computed on Draws' thread) and other (the rest of step()); each phase without those inside it.
build, queue, read and draw are the engine thread's host work (host: their sum); on the CPU the
device is the CPU too, and runs beside the host's work (llguidance's more slowly for it). Printed
per case: steps, tokens (a fed newcomer draws none while fed), free and masked rows' tokens and
the ms between two tokens of a row of each kind (its rows' mean), the mean, median and 90th
percentile of each phase's ms a step, the steps whose rows changed (a row left or joined), rows
joined, slot rebuilds (Slots.inputs with rows changed), new Slots (resized), prefill calls, the
masks' host seconds (the thread's and the draws'). --rounds repeats the cases, interleaved; --ab
runs each case twice a round, with hold off (`wait`: every step waits for its rows' masks) and on
(`hold`: a masked row whose mask is not done sits the step out), each first in turn.
--mask-delay MS adds MS to every call of llguidance's masks (constraints.words, on Draws' thread):
a mask slower than this CPU's step, as a GPU's step is faster than its host's masks."""
import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

# the package of the checkout this script is in, not another installed copy; its tests' models
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlx_flashnorm import constraints  # noqa: E402
from mlx_flashnorm.bench.load import PERSON, SCHEMA as STORY, prompt_of  # noqa: E402
from conftest import TINY_LLAMA  # noqa: E402
from mlx_flashnorm.bench.decode import random_weights  # noqa: E402
from mlx_flashnorm.decoding import context_length  # noqa: E402
from mlx_flashnorm.loader import build_model, load, prepare  # noqa: E402
from mlx_flashnorm.serve import engine as engine_module, slots as slots_module  # noqa: E402
from mlx_flashnorm.serve.batch_worker import kv_limits, warmup  # noqa: E402
from mlx_flashnorm.serve.engine import FEED_WAIT, BatchEngine  # noqa: E402
from mlx_flashnorm.serve.openai_api import parse_call  # noqa: E402
from mlx_flashnorm.serve.prompt_cache import PromptCache  # noqa: E402
from mlx_flashnorm.serve.sequence import Request  # noqa: E402

PHASES = ["build", "prefill", "place", "queue", "eval", "wait", "read", "draw", "other"]
HOST = ["build", "queue", "read", "draw"]  # the engine thread's host work
CASES = ["free", "spread", "half", "all"]
SCHEMAS = {"person": PERSON, "story": STORY}
# a random Llama of two small layers over SmolLM2's vocabulary
TINY = dict(TINY_LLAMA, max_position_embeddings=1024)


def tiny_model(vocab, layers=TINY["num_hidden_layers"]):
    """The tiny random Llama (TINY) over `vocab` token ids, of `layers` layers."""
    config = dict(TINY, vocab_size=vocab, num_hidden_layers=layers)
    weights = random_weights(config, seed=3, scale=0.09)
    return prepare(build_model(config, weights, progress=False), norm="flash", bits=0)


class Clock:
    """Per phase of the current step: wall seconds (wall) and the calling thread's CPU seconds
    (cpu), each phase's own (the phases timed inside it excluded), and counts of events; wraps
    callables to add their time to a phase (wave_steps.py's clock too)."""

    def __init__(self):
        self.wall, self.cpu = defaultdict(float), defaultdict(float)
        self.counts = defaultdict(int)
        self.inner = [(0.0, 0.0)]  # per open phase: the (wall, CPU) seconds of its inner phases

    def clear(self):
        self.wall.clear()
        self.cpu.clear()

    def timed(self, f, phase):
        def run(*a, **k):
            wall, cpu = time.perf_counter(), time.thread_time()
            self.inner.append((0.0, 0.0))
            try:
                return f(*a, **k)
            finally:
                wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
                inner_wall, inner_cpu = self.inner.pop()
                self.wall[phase] += wall - inner_wall
                self.cpu[phase] += cpu - inner_cpu
                outer_wall, outer_cpu = self.inner[-1]
                self.inner[-1] = (outer_wall + wall, outer_cpu + cpu)
        return run


def time_reads(engine, clock, phase="read"):
    """engine._read timed as `phase`, the wait for its step's tokens apart (phase "wait")."""
    read = clock.timed(engine._read, phase)
    wait = clock.timed(lambda step: mx.eval(step.tokens, [d for _, d, _ in engine.draws.drawn]),
                       "wait")

    def waited_read(step):
        wait(step)
        return read(step)

    engine._read = waited_read


def instrument(engine, clock):
    """Wrap the engine's phases (on the instance, and the modules' functions it calls) in clock;
    returns a function that undoes the module-level wraps."""
    for name, phase in (("_prefill", "prefill"), ("_place", "place")):
        setattr(engine, name, clock.timed(getattr(engine, name), phase))
    engine.draws.draw = clock.timed(engine.draws.draw, "draw")
    time_reads(engine, clock)
    saved = [(engine_module, "queue_step", "queue"), (mx, "async_eval", "eval")]
    saved = [(m, n, getattr(m, n), phase) for m, n, phase in saved]
    for m, n, f, phase in saved:
        setattr(m, n, clock.timed(f, phase))
    inputs = slots_module.Slots.inputs

    def counted_inputs(s, *a):
        clock.counts["rebuilds"] += bool(s.dirty)
        return inputs(s, *a)

    slots_module.Slots.inputs = counted_inputs

    def undo():
        for m, n, f, _ in saved:
            setattr(m, n, f)
        slots_module.Slots.inputs = inputs
    return undo


def run_case(model, tokenizer, case, args, seed, hold=True):
    rows, budget, _ = kv_limits(model, args.clients)
    engine = BatchEngine(model, rows, 2048, PromptCache(512 * 2**20),
                         feed_wait=FEED_WAIT if args.feed_wait else None, kv_budget=budget,
                         hold=hold)
    warmup(engine)
    vocab = model.args.vocab_size
    stops = frozenset(tokenizer.eos_token_ids)
    defaults = dict(max_tokens=args.max_tokens, temp=0.0, top_p=1.0, top_k=0)
    rng = np.random.default_rng(seed)
    sent = [0] * args.clients
    tag = f"{case}{seed}"
    built = [0.0]  # seconds of the constraints built since the last step began

    def add(i):
        schema = case == "all" or case == "half" and i < args.clients // 2
        n = (int(rng.integers(args.short, args.long + 1)) if case == "spread"
             else args.max_tokens)
        body = {"messages": [{"role": "user", "content": prompt_of(i, sent[i], tag)}],
                "max_tokens": n, "temperature": 0.0}
        if schema:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": args.schema, "schema": SCHEMAS[args.schema]}}
        g = parse_call(body, True, tokenizer, context_length(model), vocab, defaults).generation
        began = time.perf_counter()  # (the batch worker builds it on the engine's thread)
        constraint = g.constraint(tokenizer, vocab)
        built[0] += time.perf_counter() - began
        r = Request(g.tokens, n, 0.0, stop_tokens=stops, constraint=constraint)
        r.client = i
        sent[i] += 1
        engine.add(r)

    for i in range(args.clients):
        add(i)
    clock = Clock()
    undo = instrument(engine, clock)
    steps, last, last_slots = [], frozenset(), None
    masks = engine.mask_seconds
    try:
        for n in range(args.warm + args.steps):
            clock.clear()
            clock.wall["build"], built[0] = built[0], 0.0
            counts = dict(clock.counts)
            calls = engine.prefill_calls
            began = time.perf_counter()
            events = engine.step()
            total = time.perf_counter() - began + clock.wall["build"]
            for e in events:
                if e.finish_reason:
                    add(e.request.client)
            rows_now = frozenset(map(id, engine.rows))
            if n == args.warm:
                masks = engine.mask_seconds
            if n >= args.warm:
                free = [r for r in engine.rows if r.constraint is None]
                phases = {p: clock.wall.get(p, 0.0) for p in PHASES}
                phases["other"] = total - sum(phases.values())
                steps.append(dict(phases, total=total, tokens=len(events),
                                  free_tokens=sum(e.request.constraint is None for e in events),
                                  free_rows=len(free), masked_rows=len(engine.rows) - len(free),
                                  changed=rows_now != last, joined=len(rows_now - last),
                                  rebuilds=clock.counts["rebuilds"] - counts.get("rebuilds", 0),
                                  resized=engine.slots is not last_slots,
                                  calls=engine.prefill_calls - calls,
                                  constrained=sum(r.constraint is not None for r in engine.rows)))
            last, last_slots = rows_now, engine.slots
    finally:
        undo()
    steps[-1]["mask_seconds"] = engine.mask_seconds - masks
    return steps


def report(case, steps):
    n = len(steps)
    tokens = sum(s["tokens"] for s in steps)
    total = sum(s["total"] for s in steps)
    line = (f"{case:12s} steps {n}  tokens {tokens} ({tokens / n:.1f}/step, "
            f"{tokens / total:.0f} tok/s)  step mean {1e3 * total / n:.2f} ms  "
            f"median {1e3 * statistics.median(s['total'] for s in steps):.2f} ms  "
            f"constrained rows {statistics.mean(s['constrained'] for s in steps):.1f}")
    print(line)
    free = sum(s["free_tokens"] for s in steps)
    kinds = []
    for kind, made, rows in (("free", free, "free_rows"), ("masked", tokens - free, "masked_rows")):
        mean_rows = statistics.mean(s[rows] for s in steps)
        between = f"{1e3 * total * mean_rows / made:.2f} ms" if made else "-"
        kinds.append(f"{kind} rows {mean_rows:.1f}: {made} tokens, {between} between a row's two")
    print("   " + "; ".join(kinds) + f"; masks {1e3 * steps[-1]['mask_seconds'] / n:.3f} ms/step")
    print("   ms/step  " + " ".join(f"{p:>7s}" for p in PHASES + ["host"]))
    p90 = (lambda xs: statistics.quantiles(xs, n=10)[-1])
    for name, f in (("mean", statistics.mean), ("median", statistics.median), ("p90", p90)):
        cells = [1e3 * f([s[p] for s in steps]) for p in PHASES]
        cells.append(1e3 * f([sum(s[p] for p in HOST) for s in steps]))
        print(f"   {name:7s}  " + " ".join(f"{c:7.3f}" for c in cells))
    print(f"   changed {sum(s['changed'] for s in steps)}  joined "
          f"{sum(s['joined'] for s in steps)}  rebuilds {sum(s['rebuilds'] for s in steps)}  "
          f"resized {sum(s['resized'] for s in steps)}  prefill calls "
          f"{sum(s['calls'] for s in steps)}  steps with a call "
          f"{sum(bool(s['calls']) for s in steps)}")
    sys.stdout.flush()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--short", type=int, default=40)
    p.add_argument("--long", type=int, default=80)
    p.add_argument("--steps", type=int, default=300, help="steps measured per case")
    p.add_argument("--warm", type=int, default=40, help="steps run before those measured")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--ab", action="store_true", help="each case with hold off (every step waits "
                   "for its masks), then on")
    p.add_argument("--schema", choices=list(SCHEMAS), default="person")
    p.add_argument("--mask-delay", type=float, default=0.0, help="ms added to every mask call")
    p.add_argument("--feed-wait", action="store_true",
                   help="the server's bound on feeding (FEED_WAIT): on this CPU's slow steps it "
                        "prefills every newcomer, where a GPU's feeds them")
    args = p.parse_args(argv)
    cases = args.cases.split(",")
    if set(cases) - set(CASES):
        p.error(f"cases: {', '.join(CASES)}")
    model, tokenizer = load(None, dtype="float32", progress=False)
    if args.model == "tiny":
        model = tiny_model(model.args.vocab_size)
    constraints.ll_tokenizer(tokenizer, model.args.vocab_size)  # built once, outside the steps
    if args.mask_delay:
        words = constraints.words
        constraints.words = lambda c: time.sleep(args.mask_delay / 1e3) or words(c)
    for k in range(args.rounds):
        for case in cases:
            # (odd rounds in the other order: neither variant always second)
            for variant in (["wait", "hold"][::1 - 2 * (k % 2)] if args.ab else [""]):
                steps = run_case(model, tokenizer, case, args, seed=k, hold=variant != "wait")
                report(f"{case} {variant}".strip(), steps)


if __name__ == "__main__":
    main()
