"""`python -m mlx_flashnorm.bench.latency`: what a user waits for over a conversation (issue 15).

Every mode plays the same seeded series of requests in a process of its own, started fresh, so its
first request pays its own cold start (MLX's kernel compilation, our kernels, the decode step's
trace). The series is a conversation resent in full each turn, as an OpenAI-style client does:
each prompt is the previous one plus the reply plus a new user message (cut from the front to fit
the context), and max_tokens varies from request to request. Our modes warm up after loading as
the generate, chat and server commands do by default on this device (decoding.wants_warmup), or
as --warmup/--no-warmup say; mlx-lm has no warm-up. Reported per mode: load time, warm-up time,
time to first token (TTFT) of the first request, the cold start (their sum: what the first user
of a fresh process waits), median and max TTFT over the other requests, and end-to-end tokens/s
(generated tokens / wall time of the whole series, first request included, load and warm-up
not). With --rounds > 1 the modes take turns (rms flash mlx-lm rms flash ...), each time in a new
process, so that a cache MLX keeps on disk between processes helps every mode alike after the
first round.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from ..cli import add_model_args
from ..errors import HelpFormatter, UserError, run_cli
from ..decoding import wants_warmup, warmup
from ..loader import resolve_dtype
from .decode import (EAGER, PEER, context_length, device_name, gguf_checkpoint, load_mlx_lm,
                     load_ours, log, mlx_lm_runner, our_runner, parse_modes, random_checkpoint,
                     random_shape, timed, write_atomic)


def series(n, seed, vocab_size, context, most_tokens=128):
    """n requests [prompt token ids, max_tokens] of a conversation resent in full each turn;
    max_tokens is drawn from most_tokens // 16 (at least 1) to most_tokens."""
    rng = random.Random(seed)
    stream, requests = [], []
    for _ in range(n):
        # the user's message
        stream += [rng.randrange(vocab_size) for _ in range(rng.randint(16, 160))]
        max_tokens = rng.randint(max(1, most_tokens // 16), most_tokens)
        prompt = stream[-(context - max_tokens):]
        requests.append([prompt, max_tokens])
        # the reply, resent next turn
        stream += [rng.randrange(vocab_size) for _ in range(max_tokens)]
    return requests


def worker(mode, plan_file):
    """One mode in this process: load, play the series, write result-MODE.json beside the plan."""
    plan = json.loads(Path(plan_file).read_text())
    folder, bits = Path(plan["folder"]), plan["bits"]
    dtype, group_size = plan["dtype"], plan["group_size"]
    t0 = time.perf_counter()
    compiled = False if mode.endswith(EAGER) else None
    if mode == PEER:
        model = load_mlx_lm(folder, bits, dtype, group_size)
        run = mlx_lm_runner(model)
    else:
        model = load_ours(folder, mode.removesuffix(EAGER), bits, dtype, group_size)
        run = our_runner(model, compiled=compiled)
    mx.eval(model.parameters())
    load_s = time.perf_counter() - t0
    warmup_s = None
    if plan["warmup"] and mode != PEER:
        t0 = time.perf_counter()
        warmup(model, compiled=compiled)  # the path the requests take
        warmup_s = time.perf_counter() - t0
    requests = []
    for prompt, max_tokens in plan["requests"]:
        first, rest = timed(run, mx.array(prompt), max_tokens)
        requests.append({"prompt": len(prompt), "max_tokens": max_tokens, "ttft_s": first,
                         "total_s": first + rest})
    result = {"mode": mode, "pid": os.getpid(), "device": device_name(), "load_s": load_s,
              "warmup_s": warmup_s, "requests": requests}
    write_atomic(Path(plan_file).with_name(f"result-{mode}.json"), json.dumps(result))


def run_worker(mode, plan_file):
    r = subprocess.run([sys.executable, "-m", "mlx_flashnorm.bench.latency", "--worker", mode,
                        "--plan", str(plan_file)], capture_output=True, text=True)
    sys.stderr.write(r.stderr)
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "no message"
        raise UserError(f"mode {mode}: its process failed (exit {r.returncode}): {last}")
    return json.loads(plan_file.with_name(f"result-{mode}.json").read_text())


def summarize(runs):
    """A mode's rounds -> the table's numbers."""
    rest = [q["ttft_s"] for run in runs for q in run["requests"][1:]]
    e2e = [sum(q["max_tokens"] for q in run["requests"])
           / sum(q["total_s"] for q in run["requests"]) for run in runs]
    return {"load_s": [run["load_s"] for run in runs],
            "warmup_s": [run["warmup_s"] for run in runs],
            "first_ttft_s": [run["requests"][0]["ttft_s"] for run in runs],
            "cold_start_s": [run["load_s"] + (run["warmup_s"] or 0) + run["requests"][0]["ttft_s"]
                             for run in runs],
            "ttft_median_s": statistics.median(rest) if rest else None,
            "ttft_max_s": max(rest) if rest else None,
            "e2e_tps": e2e, "e2e_tps_median": statistics.median(e2e)}


def table(report):
    def secs(xs):
        return " / ".join("-" if x is None else f"{x:.2f}" for x in xs)

    def opt(x):
        return "-" if x is None else f"{x:.3f}"

    lines = [f"{report['model']} | weights {report['weights']} | activations {report['dtype']} | "
             f"device: {report['device']} | MLX {report['mlx']} | mlx-lm {report['mlx_lm']} | "
             f"{len(report['requests'])} requests (seed {report['seed']}), "
             f"{report['rounds']} round(s), each mode in a fresh process per round, "
             f"{'with' if report['warmup'] else 'no'} warm-up", "",
             "| mode | load s | warm-up s | TTFT first request s | cold start s "
             "| TTFT median s (rest) | TTFT max s (rest) | end-to-end tok/s | vs rms | vs mlx-lm |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    res = report["results"]
    for mode, s in res.items():
        ratios = [f"{s['e2e_tps_median'] / res[b]['e2e_tps_median']:.2f}" if b in res else "-"
                  for b in ("rms", PEER)]
        lines.append(f"| {mode} | {secs(s['load_s'])} | {secs(s['warmup_s'])} "
                     f"| {secs(s['first_ttft_s'])} | {secs(s['cold_start_s'])} "
                     f"| {opt(s['ttft_median_s'])} | {opt(s['ttft_max_s'])} "
                     f"| {statistics.median(s['e2e_tps']):.1f} | {' | '.join(ratios)} |")
    lines += ["", "Per round: values separated by /; cold start = load + warm-up + TTFT of the "
              "first request; end-to-end tok/s is the median over rounds. TTFT per request (s, "
              "median over rounds):", "",
              f"| request | prompt | max_tokens | {' | '.join(res)} |",
              "| ---: | ---: | ---: |" + " ---: |" * len(res)]
    runs = report["runs"]
    for i, (prompt, max_tokens) in enumerate(report["requests"]):
        cells = [f"{statistics.median(run['requests'][i]['ttft_s'] for run in runs[m]):.3f}"
                 for m in res]
        lines.append(f"| {i + 1} | {prompt} | {max_tokens} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def arg_parser():
    p = argparse.ArgumentParser(prog="python -m mlx_flashnorm.bench.latency",
                                description=__doc__.split("\n\n")[1], formatter_class=HelpFormatter)
    p.add_argument("--modes", default="rms,flash,mlx-lm",
                   help="comma-separated, as the bench takes them")
    p.add_argument("--shape", help="random weights of this architecture instead of the embedded "
                                   "SmolLM2 (openelm-270m, smollm2-135m, llama-3.2-1b)")
    p.add_argument("--config", action="append", metavar="FILE",
                   help="random weights of the architecture of a Hugging Face config.json")
    p.add_argument("--tiny", action="store_true",
                   help="a 2-layer OpenELM-shaped random model: a smoke test in seconds")
    add_model_args(p, "--bits", "--group-size", "--dtype",
                   bits=dict(help="weight bits, 0 for full precision (default: 4 for random "
                                  "weights; the embedded model as shipped, Q4_1)"),
                   group_size=dict(help="weights per scale/bias"))
    p.add_argument("--requests", type=int, default=8, help="requests in the series")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="the most tokens a request asks for (each draws from a 16th of it to it)")
    add_model_args(p, "--warmup", warmup=dict(
        help="our modes warm up after loading (default: as the commands do on this device)"))
    p.add_argument("--rounds", type=int, default=1, help="fresh processes per mode, interleaved")
    p.add_argument("--seed", type=int, default=0, help="seed of the series")
    p.add_argument("--out", default="out/latency", help="folder for latency.md, latency.json")
    # internal: run one mode (a process per mode)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    return p


def prepare_model(args, folder):
    """Write the weights every mode loads to folder: (label, weights, bits for the loaders,
    config)."""
    if args.shape or args.config or args.tiny:
        chosen = [o for o, v in (("--shape", args.shape), ("--config", args.config),
                                 ("--tiny", args.tiny)) if v]
        if len(chosen) > 1:
            raise UserError(f"{chosen[0]} and {chosen[1]} both choose the model: keep one")
        name, config = random_shape(args)
        bits = 4 if args.bits is None else args.bits or None
        log(f"building {name} (random weights)...")
        random_checkpoint(folder, config)
        weights = f"Q{bits} group {args.group_size}" if bits else "full"
        return f"{name} (random weights)", weights, bits, config
    if args.bits:
        raise UserError(f"the embedded SmolLM2 GGUF is already quantized: --bits {args.bits} "
                        "would stack two rounding errors; drop --bits (or --bits 0 for full "
                        "precision), or choose random weights (--shape, --config, --tiny)")
    # --bits 0: dequantized
    label, config = gguf_checkpoint(None, folder, args.bits, args.group_size)
    q = config.get("quantization")
    return label, f"Q{q['bits']} group {q['group_size']}" if q else "full", None, config


def main(argv=None):
    args = arg_parser().parse_args(argv)
    if args.worker:
        return worker(args.worker, args.plan)
    modes = parse_modes(args.modes)
    if args.requests < 1 or args.rounds < 1 or args.max_tokens < 1:
        raise UserError("need --requests >= 1, --rounds >= 1 and --max-tokens >= 1")
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        label, weights, bits, config = prepare_model(args, Path(tmp) / "model")
        mx.clear_cache()
        dtype = resolve_dtype(args.dtype, config)
        if context_length(config) < 300:
            raise UserError(f"the model's context is {context_length(config)} tokens; the series "
                            "needs 300")
        requests = series(args.requests, args.seed, config["vocab_size"], context_length(config),
                          args.max_tokens)
        plan = Path(tmp) / "plan.json"
        plan.write_text(json.dumps({"folder": str(Path(tmp) / "model"), "bits": bits,
                                    "dtype": dtype, "group_size": args.group_size,
                                    "requests": requests,
                                    "warmup": wants_warmup(args)}))
        runs = {m: [] for m in modes}
        for r in range(args.rounds):
            for mode in modes:
                log(f"round {r + 1}/{args.rounds}: {mode}")
                runs[mode].append(run_worker(mode, plan))
    import mlx_lm

    command = " ".join(sys.argv[1:] if argv is None else argv)
    report = {"model": label, "weights": weights, "dtype": dtype,
              "device": runs[modes[0]][0]["device"], "mlx": mx.__version__,
              "mlx_lm": mlx_lm.__version__, "seed": args.seed, "rounds": args.rounds,
              "warmup": wants_warmup(args),
              "command": "python -m mlx_flashnorm.bench.latency " + command,
              "requests": [[len(p), n] for p, n in requests],
              "results": {m: summarize(runs[m]) for m in modes}, "runs": runs}
    md = table(report)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "latency.md", f"Command: `{report['command']}`\n\n{md}")
    write_atomic(out / "latency.json", json.dumps(report, indent=1))
    print(md)
    print(f"wrote {out}/latency.md, latency.json")


if __name__ == "__main__":
    sys.exit(run_cli(main))
