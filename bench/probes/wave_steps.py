"""Where the host time of a wave of newcomers goes: N chat requests arriving at once at a
BatchEngine (beside R rows already decoding), stepped until every one has its first token.

    PYTHONPATH=$PWD python bench/probes/wave_steps.py [--newcomers 64,128,256] [--running 0,32]
        [--waves 2] [--tokens 8] [--feed server|always|never] [--layers 30] [--vocab 2048]
        [--rounds 1] [--ab REV]

It drives a BatchEngine directly (no HTTP), set up as bench.serve's in-process engine (its rows and
kv budget from batch_worker.kv_limits, the server's prefill step and prompt cache, warmed up), with
the embedded SmolLM2's tokenizer and chat template (bench.load's prompts: about 47 tokens, the
first 30 or so the template's system prompt, shared; their ids taken modulo --vocab) and
constrained_steps' tiny random Llama, of --layers layers (SmolLM2-135M's 30 by default: the host's
work a layer shows) over --vocab ids (its logits' matmul, most of a CPU step, small). Per case
(N, R): R requests decode (max_tokens long enough to outlast the waves); then --waves waves of N
newcomers (--tokens tokens each) are added at once, each wave once the one before has finished
(the later waves find the shared prefix in the prompt cache and in the free slots, as a client's
second request does). --feed: the server's
feed_wait (`server`: on this CPU's slow steps it prefills newcomers a GPU would feed), no bound
(`always`: fed wherever feed allows, as on a GPU's fast steps) or feed 0 (`never`).

Each wave's steps, from the one that finds the newcomers waiting to the one that reads the last
newcomer's first token, are timed apart, split into phases, each without the phases inside it:
admit (BatchEngine._prefill's own work: the admission loop), lookup (PromptCache.find,
Slots.reuse), store (PromptCache.store_rows, also from Slots.store), fill (Filling's caches:
KVCache, one_row_cache, Block.prefix), feed (_feed: fed newcomers' kv gathered), together
(_prefill_together: its prefix gather, token array, kv slices), model (the model calls: prefill()
and eager forward passes, their graphs built and queued), join (_join), place (_place), insert
(Slots.insert: the scatter into the slots), resize (new, resized or moved Slots), queue
(runner.queue_step), read (_read), eval (mx.async_eval), wait (mx.eval, and the queued step's
tokens before _read) and other (the rest of step()). Host phases are timed in the engine thread's
CPU time (time.thread_time: on two cores the device's threads stretch the host's wall time at
random), their sum `host`; eval and wait are the device's, in wall time (`device`; on this CPU
async_eval waits for the step before). Printed per wave: its steps, the model calls that prefilled
(prefill_calls), host ms (and per newcomer), device ms, wall ms, the steps' wall times (the running
rows' time per token: median and max), each host phase's ms over the wave.

--ab REV: each case also with engine.py, slots.py and prompt_cache.py as they are at git revision
REV (loaded as modules of their own), each variant first in turn by round."""
import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the package of this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from constrained_steps import Clock, time_reads, tiny_model  # noqa: E402
from mlx_flashnorm.bench.load import prompt_of  # noqa: E402
from mlx_flashnorm.decoding import context_length  # noqa: E402
from mlx_flashnorm.loader import load  # noqa: E402
from mlx_flashnorm.serve import engine as engine_now, prompt_cache as cache_now  # noqa: E402
from mlx_flashnorm.serve import slots as slots_now  # noqa: E402
from mlx_flashnorm.serve.batch_worker import kv_limits, warmup  # noqa: E402
from mlx_flashnorm.serve.openai_api import parse_call  # noqa: E402
from mlx_flashnorm.serve.sequence import Request  # noqa: E402
from mlx_flashnorm.server import PREFILL_STEP, PROMPT_CACHE_MB  # noqa: E402

PHASES = ["admit", "lookup", "store", "fill", "feed", "together", "model", "join", "place",
          "insert", "resize", "queue", "read", "eval", "wait", "other"]
DEVICE = ["eval", "wait"]
AB = ["engine", "slots", "prompt_cache"]  # the serve modules --ab loads at a revision


def modules_at(rev):
    """(engine, slots, prompt_cache) as at git revision rev, as modules of their own (their
    imports of each other rewritten to those copies; the rest of the package the checkout's)."""
    loaded = {}
    for name in reversed(AB):  # (each after those it imports)
        text = subprocess.run(["git", "show", f"{rev}:mlx_flashnorm/serve/{name}.py"], cwd=ROOT,
                              check=True, capture_output=True, text=True).stdout
        for other in AB:
            text = text.replace(f"from .{other} import", f"from ._ab_{other} import")
        full = f"mlx_flashnorm.serve._ab_{name}"
        spec = importlib.util.spec_from_loader(full, loader=None)
        module = importlib.util.module_from_spec(spec)
        module.__package__ = "mlx_flashnorm.serve"
        sys.modules[full] = module
        exec(compile(text, f"{rev}:{name}.py", "exec"), module.__dict__)
        loaded[name] = module
    return loaded["engine"], loaded["slots"], loaded["prompt_cache"]


def instrument(engine, clock, mods):
    """Wrap the engine's phases in clock (on the instance, and on the classes and module functions
    it calls); returns a function that undoes the wraps of classes and modules."""
    engine_module, slots_module, cache_module = mods
    for name, phase in (("_prefill", "admit"), ("_feed", "feed"), ("_join", "join"),
                        ("_prefill_together", "together"), ("_place", "place")):
        setattr(engine, name, clock.timed(getattr(engine, name), phase))
    time_reads(engine, clock)
    Slots, PromptCache = slots_module.Slots, cache_module.PromptCache
    targets = [(engine_module, "prefill", "model"), (type(engine.model), "__call__", "model"),
               (engine_module, "queue_step", "queue"), (engine_module, "one_row_cache", "fill"),
               (engine_module, "KVCache", "fill"), (cache_module.Block, "prefix", "fill"),
               (PromptCache, "find", "lookup"), (Slots, "reuse", "lookup"),
               (PromptCache, "store_rows", "store"), (Slots, "insert", "insert"),
               (Slots, "resized", "resize"), (Slots, "moved", "resize"),
               (engine_module, "Slots", "resize"), (mx, "async_eval", "eval"),
               (mx, "eval", "wait")]
    saved = [(m, n, m.__dict__[n] if isinstance(m, type) else getattr(m, n), phase)
             for m, n, phase in targets]
    for m, n, f, phase in saved:
        setattr(m, n, clock.timed(f, phase))

    def undo():
        for m, n, f, _ in saved:
            setattr(m, n, f)
    return undo


def request(model, tokenizer, i, k, tag, max_tokens):
    """Client i's k-th chat request, its token ids taken modulo the model's vocabulary, with no
    stop token (every answer max_tokens long)."""
    body = {"messages": [{"role": "user", "content": prompt_of(i, k, tag)}],
            "max_tokens": max_tokens, "temperature": 0.0}
    defaults = dict(max_tokens=max_tokens, temp=0.0, top_p=1.0, top_k=0)
    g = parse_call(body, True, tokenizer, context_length(model), tokenizer.vocab_size,
                   defaults).generation
    vocab = model.args.vocab_size
    return Request([t % vocab for t in g.tokens], max_tokens, 0.0, stop_tokens=frozenset())


def run_case(model, tokenizer, n, running, args, mods, tag):
    """Each wave's measurements (a dict), and every request's tokens (to compare variants)."""
    engine_module, _, cache_module = mods
    rows, budget, _ = kv_limits(model)
    wait = {"server": engine_module.FEED_WAIT, "always": None, "never": None}[args.feed]
    engine = engine_module.BatchEngine(model, rows, PREFILL_STEP,
                                       cache_module.PromptCache(PROMPT_CACHE_MB * 2**20),
                                       feed=0 if args.feed == "never" else 32, feed_wait=wait,
                                       kv_budget=budget)
    warmup(engine)
    steps_needed = (args.waves + 1) * (args.tokens + 40) + 64
    runners = [request(model, tokenizer, i, 0, f"{tag}r", steps_needed) for i in range(running)]
    for r in runners:
        engine.add(r)
    while not all(r.generated for r in runners):
        engine.step()
    for _ in range(8):  # the step periods feed_wait reads
        engine.step()
    clock = Clock()
    undo = instrument(engine, clock, mods)
    waves, answers = [], []
    try:
        for k in range(args.waves):
            comers = [request(model, tokenizer, i, k, tag, args.tokens) for i in range(n)]
            for r in comers:
                engine.add(r)
            calls, got, totals, phases = engine.prefill_calls, 0, [], defaultdict(float)
            device = 0.0
            while got < n:
                clock.clear()
                cpu, began = time.thread_time(), time.perf_counter()
                engine.step()
                totals.append(time.perf_counter() - began)
                for p in PHASES[:-1]:
                    phases[p] += clock.cpu.get(p, 0.0)
                phases["other"] += time.thread_time() - cpu - sum(clock.cpu.values())
                device += sum(clock.wall[p] for p in DEVICE)
                got = sum(bool(r.generated) for r in comers)
            waves.append(dict(phases, steps=len(totals), calls=engine.prefill_calls - calls,
                              totals=totals, n=n, device=device))
            ids = set(map(id, comers))
            while any(id(r) in ids for r in engine.requests()):  # the wave's answers end
                engine.step()
            answers += [r.generated for r in comers]
    finally:
        undo()
    return waves, answers + [r.generated[:10] for r in runners]


def report(label, wave):
    ms = {p: 1e3 * wave[p] for p in PHASES}
    host = sum(v for p, v in ms.items() if p not in DEVICE)
    device = 1e3 * wave["device"]
    t = [1e3 * x for x in wave["totals"]]
    print(f"{label:28s} steps {wave['steps']:3d} calls {wave['calls']:3d}  host {host:8.1f} ms "
          f"({host / wave['n']:.3f}/newcomer)  device {device:7.1f}  wall {sum(t):8.1f}  "
          f"step med {statistics.median(t):6.1f} max {max(t):6.1f}")
    print("    " + " ".join(f"{p}={ms[p]:.1f}" for p in PHASES if p not in DEVICE))
    sys.stdout.flush()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--newcomers", default="64,128,256")
    p.add_argument("--running", default="0,32")
    p.add_argument("--waves", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8, help="max_tokens of a newcomer")
    p.add_argument("--feed", choices=["server", "always", "never"], default="server")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--layers", type=int, default=30, help="the tiny model's (SmolLM2-135M's)")
    p.add_argument("--vocab", type=int, default=2048,
                   help="the tiny model's (prompt ids taken modulo it): its logits' matmul is "
                        "most of a CPU step's time at SmolLM2's vocabulary")
    p.add_argument("--ab", metavar="REV", help="also with the serve modules at git revision REV")
    args = p.parse_args(argv)
    _, tokenizer = load(None, dtype="float32", progress=False)
    model = tiny_model(args.vocab, args.layers)
    variants = [("now", (engine_now, slots_now, cache_now))]
    if args.ab:
        variants.append((args.ab, modules_at(args.ab)))
    for k in range(args.rounds):
        for n in map(int, args.newcomers.split(",")):
            for running in map(int, args.running.split(",")):
                tokens = {}
                for name, mods in variants[::1 - 2 * (k % 2)]:
                    waves, tokens[name] = run_case(model, tokenizer, n, running, args, mods,
                                                   f"{k}-{n}-{running}")
                    for w, wave in enumerate(waves):
                        report(f"N={n} R={running} wave {w} {name}", wave)
                if len(tokens) > 1:
                    same = len({repr(t) for t in tokens.values()}) == 1
                    print(f"    tokens {'identical' if same else 'DIFFER'} across variants")


if __name__ == "__main__":
    main()
