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

--serve: time to first token per prompt length through the servers instead, each in a process of
its own on a free port: ours and mlx_lm.server (--peer) on one MLX folder (the embedded SmolLM2
written as one under --work, as bench.serve writes it, or --model), and llama.cpp's llama-server
(--llama-server PATH) on the embedded SmolLM2's GGUF file. Each prompt is a system message and
random words whose chat-templated prompt has the length's tokens (every server counts the same:
the JSON keeps what each said), distinct for every request so that no prompt cache holds more
than the template's first tokens. After an untimed request of each length on every server, one
streaming chat request at a time, each round of --repeats asking every length of every server in
turn, the servers' order rotating; reported per length and server: the median and p90 time to the
first content.
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
from ..decoding import encode_chat, wants_warmup, warmup
from ..loader import default_model_path, load_tokenizer, resolve_dtype
from .decode import (EAGER, PEER, context_length, device_name, gguf_checkpoint, load_mlx_lm,
                     load_ours, log, mlx_lm_runner, our_runner, parse_modes, positive,
                     random_checkpoint, random_shape, timed, write_atomic)
from .load import percentile, stream_chat
from .serve import (LLAMA, check_llama_server, llama_server_command, mlx_folder, server_command,
                    start)

# --serve's prompts: an empty system message (else a template may add its own, as SmolLM2's does,
# too long for a 16-token prompt), then random words among these (one token each in most
# tokenizers)
SYSTEM = ""
WORDS = ("time year people way day man thing woman life child world school state family group "
         "country problem hand part place case week company system program question work number "
         "night point home water room mother area money story fact month lot right study book eye "
         "job word business issue side kind head house service friend father power hour game line "
         "end member law car city name team minute idea body back parent face level office door "
         "health person art war history party result change morning reason girl moment air "
         "force").split()
SERVERS = {"ours": "ours", "mlx-lm": "mlx_lm.server", LLAMA: "llama-server"}


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


def chat_prompt(tokenizer, length, rng):
    """Messages (SYSTEM, then random WORDS) whose chat-templated prompt has `length` tokens, or as
    near as whole words come, with its token count."""
    words = [rng.choice(WORDS) for _ in range(length)]
    n, tried = max(1, length // 2), {}
    while n not in tried:
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": " ".join(words[:n])}]
        tried[n] = (len(encode_chat(tokenizer, messages)), messages)
        n = min(length, max(1, n + length - tried[n][0]))
    count, messages = min(tried.values(), key=lambda t: (abs(t[0] - length), t[0]))
    return messages, count


def serve_round(ports, prompts, max_tokens, results, rotate=0):
    """One request of each length (prompts: {length: its messages}) to every server (ports: {server:
    port}) in turn, the servers' order rotated by `rotate` and one more for each length; each
    answer's {ttft_s, prompt_tokens, error} appended to results[server][length] (results None: the
    untimed warm-up)."""
    servers = list(ports)
    for i, (length, messages) in enumerate(prompts.items()):
        k = (rotate + i) % len(servers)
        for server in servers[k:] + servers[:k]:
            try:
                answer = stream_chat(ports[server], messages, max_tokens)
                row = {"ttft_s": answer.ttft, "prompt_tokens": answer.prompt_tokens,
                       "error": None if answer.ttft is not None else "no content"}
            except Exception as e:  # counted and reported, the others go on
                row = {"ttft_s": None, "prompt_tokens": None, "error": str(e)[:200]}
            if results is not None:
                results[server][length].append(row)


def ttft_summary(rows):
    """A server's answers at one length: count, failures, median and p90 TTFT (s)."""
    ttft = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    return {"requests": len(rows), "failed": len(rows) - len(ttft),
            "ttft_median_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90)}


def ttft_table(report):
    """--serve's markdown: a row per prompt length, median / p90 ms per server, and ours' median
    over each other server's (below 1: ours answers first)."""
    servers, others = list(report["servers"]), [s for s in report["servers"] if s != "ours"]
    lines = [f"{report['model']} | device: {report['device']} | MLX {report['mlx']} | "
             f"{report['repeats']} requests per length and server, one at a time, after an "
             f"untimed one; max_tokens {report['max_tokens']}; TTFT in ms, median / p90", "",
             "| prompt tokens | " + " | ".join(SERVERS[s] for s in servers)
             + "".join(f" | ours / {SERVERS[s]}" for s in others) + " |",
             "| ---: |" + " ---: |" * (len(servers) + len(others))]

    def cell(s):
        failed = f" ({s['failed']} failed)" if s["failed"] else ""
        return f"{1e3 * s['ttft_median_s']:.1f} / {1e3 * s['ttft_p90_s']:.1f}{failed}"

    for length, tokens in zip(report["lengths"], report["prompt_tokens"]):
        row = {s: report["results"][s][str(length)] for s in servers}
        ratios = [row["ours"]["ttft_median_s"] / row[s]["ttft_median_s"] for s in others]
        lines.append(f"| {tokens} | " + " | ".join(cell(row[s]) for s in servers)
                     + "".join(f" | {r:.2f}" for r in ratios) + " |")
    return "\n".join(lines) + "\n"


def serve_main(args, argv):
    """--serve: start the servers, warm them up, play the rounds, write ttft.md and ttft.json."""
    lengths = [positive(t, "--prompts") for t in args.prompts.split(",")]
    binary = args.llama_server and check_llama_server(args.llama_server, args.model)
    if args.repeats < 1 or (args.max_tokens or 4) < 1:
        raise UserError("need --repeats >= 1 and --max-tokens >= 1")
    work, max_tokens = Path(args.work), args.max_tokens or 4
    folder = Path(args.model) if args.model else mlx_folder(work)
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder}: not an MLX model folder (config.json missing)")
    tokenizer, rng = load_tokenizer(folder), random.Random(args.seed)
    # per length: the warm-up's prompt, then each round's
    prompts = {n: [chat_prompt(tokenizer, n, rng) for _ in range(args.repeats + 1)]
               for n in lengths}
    commands = {"ours": lambda port: server_command("ours", folder, port,
                                                    args.server_args.split())}
    if args.peer:
        commands["mlx-lm"] = lambda port: server_command("mlx-lm", folder, port, [])
    if binary:  # one slot, its context room for the longest prompt and max_tokens
        commands[LLAMA] = lambda port: llama_server_command(
            binary, default_model_path(), port, 1, max(lengths) + max_tokens)
    kinds = list(commands)
    results = {s: {n: [] for n in lengths} for s in kinds}
    ports, processes = {}, []
    work.mkdir(parents=True, exist_ok=True)
    try:
        for kind in kinds:
            log(f"starting {SERVERS[kind]}...")
            with open(work / f"{kind}.log", "w") as server_log:  # (the child keeps its copy)
                process, ports[kind] = start(kind, commands[kind], server_log)
            processes.append(process)
        serve_round(ports, {n: p[0][0] for n, p in prompts.items()}, max_tokens, None)
        for r in range(args.repeats):
            log(f"round {r + 1}/{args.repeats}")
            serve_round(ports, {n: p[r + 1][0] for n, p in prompts.items()}, max_tokens, results,
                        r)
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=60)
    report = {"model": folder.name, "device": device_name(), "mlx": mx.__version__,
              "command": "python -m mlx_flashnorm.bench.latency " + " ".join(argv),
              "servers": kinds, "repeats": args.repeats, "max_tokens": max_tokens,
              "lengths": lengths, "prompt_tokens": [prompts[n][1][1] for n in lengths],
              "results": {s: {str(n): ttft_summary(results[s][n]) for n in lengths}
                          for s in kinds},
              "requests": {s: {str(n): results[s][n] for n in lengths} for s in kinds}}
    md = ttft_table(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "ttft.md", f"Command: `{report['command']}`\n\n{md}")
    write_atomic(out / "ttft.json", json.dumps(report, indent=1))
    print(md)
    print(f"wrote {out}/ttft.md, ttft.json")


def arg_parser():
    p = argparse.ArgumentParser(prog="python -m mlx_flashnorm.bench.latency",
                                description=__doc__.split("\n\n")[1], formatter_class=HelpFormatter)
    p.add_argument("--modes", help="comma-separated, as the bench takes them (default: "
                                   "rms,flash,mlx-lm)")
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
    p.add_argument("--max-tokens", type=int,
                   help="the most tokens a request asks for (each draws from a 16th of it to it; "
                        "default 128); --serve: every request's (default 4)")
    add_model_args(p, "--warmup", warmup=dict(
        help="our modes warm up after loading (default: as the commands do on this device)"))
    p.add_argument("--rounds", type=int, default=1, help="fresh processes per mode, interleaved")
    p.add_argument("--seed", type=int, default=0, help="seed of the series")
    p.add_argument("--out", default="out/latency",
                   help="folder for latency.md, latency.json (--serve: ttft.md, ttft.json)")
    p.add_argument("--serve", action="store_true",
                   help="time to first token per prompt length through the servers instead")
    p.add_argument("--prompts", default="16,128,512,1792",
                   help="--serve: prompt lengths in tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=9,
                   help="--serve: timed requests per length and server")
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True,
                   help="--serve: also mlx_lm.server on the same weights")
    p.add_argument("--llama-server", metavar="PATH",
                   help="--serve: also llama.cpp's llama-server binary on the GGUF file")
    add_model_args(p, "--model", model=dict(help="--serve: the MLX model folder ours and "
                                                 "mlx_lm.server load (default: the embedded "
                                                 "SmolLM2, written under --work)"))
    p.add_argument("--server-args", default="", help="--serve: extra flags for our server")
    p.add_argument("--work", default="out/latency-serve",
                   help="--serve: folder for the converted model and the servers' logs")
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
    argv = sys.argv[1:] if argv is None else argv
    serve_only = [f for f, on in (("--model", args.model), ("--llama-server", args.llama_server),
                                  ("--server-args", args.server_args)) if on]
    if args.serve:
        chosen = [f for f, on in (("--modes", args.modes), ("--shape", args.shape),
                                  ("--config", args.config), ("--tiny", args.tiny),
                                  ("--bits", args.bits is not None), ("--rounds", args.rounds != 1),
                                  ("--requests", args.requests != 8)) if on]
        if chosen:
            raise UserError(f"{chosen[0]} is for the conversation, not --serve (the servers load "
                            "their model as a user starts them): drop it")
        return serve_main(args, argv)
    if serve_only:
        raise UserError(f"{serve_only[0]} is for --serve: add --serve or drop it")
    args.max_tokens = 128 if args.max_tokens is None else args.max_tokens
    modes = parse_modes(args.modes or "rms,flash,mlx-lm")
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

    command = " ".join(argv)
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
