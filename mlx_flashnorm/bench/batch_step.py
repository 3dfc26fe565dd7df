"""Host cost of the continuous batch's decode step (engine.BatchEngine) at 1, 8 and 32 rows.

On a fast GPU decoding a small model is bound by the host work per step (Python building the
graph, MLX submitting each operation), so a batched step should cost about what a one-row step
costs. For each row count, after the rows joined and the step was traced:

- build: the step's graph (the compiled call and the sampling), in Python; submit: mx.async_eval
  (on the CPU backend this runs the work too); wait: mx.eval after it;
- ops / non-view: the operations in the step's graph (bench.step_graph's count; a compiled step
  counts the operations it replays);
- engine step: the median wall time of BatchEngine.step() in its steady state (pipelined: the
  next step queued before this one is read), with the events handed out.

    python -m mlx_flashnorm.bench.batch_step [--model PATH] [--narrow] [--rows 1,8,32] \
[--capacity-step N]

Requests: prompts of 20 + i tokens, 64 new tokens (bench.serve's shape). --narrow: a random model
of SmolLM2-135M's depth (30 layers) and 64 wide, where the device work is small beside the
host's: its engine step is close to the host cost per step. --capacity-step: the static caches'
capacity bucket (decoding.CAPACITY_STEP, 1024): on the CPU the attention over the whole capacity
is real work, which a GPU does in a fraction of a millisecond."""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from .. import decoding, forms
from ..cli import add_model_args
from ..serve.engine import BatchEngine
from ..serve.sequence import Request
from ..errors import HelpFormatter, run_cli
from ..kernels import use_decode_layers
from ..loader import load
from .decode import SMOLLM2_135M, load_ours, random_checkpoint
from .step_graph import VIEWS, graph_ops

NARROW = dict(SMOLLM2_135M, hidden_size=64, intermediate_size=128, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, vocab_size=512)


def engine_with(model, rows):
    """A BatchEngine decoding `rows` greedy requests (prompts of 20.. tokens), every row joined."""
    engine = BatchEngine(model, max_batch=max(rows, 1), prefill_step=1 << 16)
    for i in range(rows):
        engine.add(Request([(7 * i + j) % 500 + 10 for j in range(20 + i)], max_tokens=64))
    while len(engine.rows) < rows:
        engine.step()
    engine.step()  # traced
    return engine


def step_parts(engine, reps):
    """Medians of (build, submit, wait) seconds of one queued step, and its operations."""
    mx.eval(engine.pending.tokens)
    b, s, w, ops = [], [], [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out, tokens = engine.slots.decode()
        t1 = time.perf_counter()
        if ops is None:
            ops = graph_ops(out, tokens, *[a for kv in engine.slots.kv for a in kv])
        mx.async_eval(out, tokens)
        t2 = time.perf_counter()
        mx.eval(out, tokens)
        t3 = time.perf_counter()
        engine.slots.tokens = tokens
        b.append(t1 - t0)
        s.append(t2 - t1)
        w.append(t3 - t2)
    return statistics.median(b), statistics.median(s), statistics.median(w), ops


def engine_step(engine, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(model, label, rows, reps, log=print, loop=True):
    """A table row per row count and form of the step, one after the other at each row count:
    where the whole-step kernels run, "kernel" (kernels.decode_layers for one row, decode_rows for
    more) and "layer loop" (both off: the model's loop over its layers' operations; loop False:
    not timed, as its graph of many rows takes long to build); elsewhere only the loop."""
    off = ("decode_layers", "decode_rows")
    forms_ = ([("kernel", ())] + [("layer loop", off)] * loop if kernels_run()
              else [("layer loop", ())])
    for n in rows:
        for name, names in forms_:
            with forms.without(*names):
                for kept in ("_batched_decode", "_batched_logits", "_compiled_decode",
                             "_compiled_logits"):
                    model.__dict__.pop(kept, None)
                engine = engine_with(model, n)
                step = engine_step(engine, reps)
                build, submit, wait, ops = step_parts(engine, reps)
            kernels = sum(1 for op in ops if op not in VIEWS)
            log(f"| {label} | {name} | {n} | {build * 1e3:.2f} | {submit * 1e3:.2f} "
                f"| {wait * 1e3:.2f} | {len(ops)} | {kernels} | {step * 1e3:.2f} |")


def kernels_run():
    """Whether decode_rows may run here (CUDA, kernels on); elsewhere the one form is the loop."""
    return use_decode_layers("decode_rows")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mlx_flashnorm.bench.batch_step",
                                description=__doc__, formatter_class=HelpFormatter)
    add_model_args(p, "--model", model=dict(help="checkpoint, repo or .gguf (default: the "
                                                 "embedded SmolLM2-135M)"))
    p.add_argument("--narrow", action="store_true", help="a random 30-layer model 64 wide instead")
    p.add_argument("--rows", default="1,8,32", help="row counts, comma-separated")
    p.add_argument("--reps", type=int, default=10, help="steps timed per row count (at most 20)")
    p.add_argument("--no-loop", action="store_true",
                   help="where the kernels run, time their step alone (not the layer loop's)")
    p.add_argument("--capacity-step", type=int, default=decoding.CAPACITY_STEP,
                   help="static cache capacity bucket, in positions")
    args = p.parse_args(argv)
    decoding.CAPACITY_STEP = args.capacity_step
    rows = [int(x) for x in args.rows.split(",")]
    print(f"device {mx.default_device()}, capacity step {args.capacity_step}")
    print("| model | step | rows | build ms | submit ms | wait ms | ops | non-view "
          "| engine step ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    if args.narrow:
        with tempfile.TemporaryDirectory() as tmp:
            model = load_ours(random_checkpoint(Path(tmp) / "narrow", NARROW), "flash", 4,
                              "float32", 32)
            measure(model, "narrow (30 x 64)", rows, args.reps, loop=not args.no_loop)
    else:
        model, _ = load(args.model, progress=False)
        measure(model, args.model or "SmolLM2-135M", rows, args.reps, loop=not args.no_loop)


if __name__ == "__main__":
    run_cli(main)
