"""llama.cpp's llama-bench on the same GGUF file in the same bench run (`bench --llama-bench PATH`):
the engine a user would pick instead of ours, as a row of the report's table and chart, with each
of our modes' ratio to it.

Matched to what our bench measures: our pp is the prefill of a pp-token prompt from an empty
cache, our tg the tokens decoded after it. So llama-bench runs `-p PP -n TG -d 0,PP` (its default
threads and batch sizes, every layer on the GPU, flash attention on) and the report takes its pp
test at depth 0 and its tg test at depth PP (TG tokens decoded after a PP-token context); every
test it ran is kept in the JSON report. llama-bench runs after our modes, in its own process, so
the ratio to it is of medians, not paired per round as the ratios between our modes are."""
import json
import shutil
import subprocess
from pathlib import Path

from ..errors import UserError
from .decode import summary

PEER = "llama.cpp"
# what the report keeps of each test
FIELDS = ("n_prompt", "n_gen", "n_depth", "avg_ts", "stddev_ts", "samples_ts", "model_size",
          "model_n_params", "model_type", "backends", "build_commit", "n_threads")


def command(binary, model, pp, tg, reps, depths=(0,)):
    """The llama-bench command line of one run: a pp-token prefill and a tg-token decode, reps times
    each, at each context depth (tokens already in the cache)."""
    cmd = [str(binary), "-m", str(model), "-ngl", "99", "-fa", "1", "-p", str(pp), "-n", str(tg),
           "-r", str(reps), "-o", "json"]
    return cmd + (["-d", ",".join(str(d) for d in depths)] if tuple(depths) != (0,) else [])


def run(cmd, log=print):
    """Run a llama-bench command line (command) and return its tests (parse); a failed run is a
    UserError naming the last line it printed."""
    log("running " + " ".join(cmd))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise UserError(f"{cmd[0]}: cannot run it ({e.strerror}); --llama-bench takes llama.cpp's "
                        "llama-bench binary")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"llama-bench failed (exit code {done.returncode}): {last}")
    return parse(done.stdout)


def compare(report, binary, model, log=print):
    """Run llama-bench on model matched to a bench report (its pp and tg, at depths 0 and pp, as
    many repetitions) and add it to the report (add_to_report)."""
    cmd = command(binary, model, report["pp"], report["tg"], report["reps"], (0, report["pp"]))
    return add_to_report(report, run(cmd, log), " ".join(cmd))


def parse(text):
    """llama-bench's `-o json` output: a list of tests, each with its prompt and generated token
    counts, context depth and per-repetition tokens/s (samples_ts); the fields in FIELDS of each."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"llama-bench printed no JSON list of tests ({e}); is it llama.cpp's "
                        "llama-bench?")
    if not isinstance(tests, list) or not tests or not all(
            isinstance(t, dict) and isinstance(t.get("samples_ts"), list) and t["samples_ts"]
            and all(k in t for k in ("n_prompt", "n_gen", "n_depth")) for t in tests):
        raise UserError("llama-bench's JSON has no tests with n_prompt, n_gen, n_depth and "
                        "samples_ts")
    return [{k: t[k] for k in FIELDS if k in t} for t in tests]


def find(tests, n_prompt, n_gen, depth):
    """The test of these counts and depth; a UserError if llama-bench did not run it."""
    for t in tests:
        if (t["n_prompt"], t["n_gen"], t["n_depth"]) == (n_prompt, n_gen, depth):
            return t
    raise UserError(f"llama-bench reported no test of {n_prompt} prompt and {n_gen} generated "
                    f"tokens at depth {depth}")


def add_to_report(report, tests, cmd):
    """Add llama.cpp to a bench report: its pp test at depth 0 and its tg test at depth pp as the
    results of mode PEER (samples, their summary, no peak memory: llama-bench does not report it),
    and to each of our modes its ratio to them (pp_vs_llama_cpp, tg_vs_llama_cpp: median over
    median); every test it ran and its command under "llama_bench"."""
    pp, tg = find(tests, report["pp"], 0, 0), find(tests, 0, report["tg"], report["pp"])
    peer = {"pp": pp["samples_ts"], "tg": tg["samples_ts"], "peak_memory_gb": None}
    for test in ("pp", "tg"):
        peer[f"{test}_summary"] = summary(peer[test])
        peer[f"{test}_vs_rms"] = peer[f"{test}_vs_mlx_lm"] = None
        for r in report["results"].values():
            r[f"{test}_vs_llama_cpp"] = (r[f"{test}_summary"]["median"]
                                         / peer[f"{test}_summary"]["median"])
    report["results"][PEER] = peer
    report["size_bytes"][PEER] = pp.get("model_size", 0)
    report["llama_bench"] = {"command": cmd, "tests": tests,
                             "ratios": "ours / llama.cpp: median over median, llama-bench run "
                                       "after ours"}
    return report


def check_args(binary, model):
    """The llama-bench binary and the GGUF file it runs, checked before any measuring: the binary
    found (a path or a name on PATH), the model a .gguf file (the same file our modes load)."""
    found = shutil.which(binary)
    if found is None:
        raise UserError(f"{binary}: no such executable; --llama-bench takes the path of "
                        "llama.cpp's llama-bench")
    if model is None or Path(model).suffix.lower() != ".gguf" or not Path(model).is_file():
        raise UserError("--llama-bench runs llama.cpp on the same file as our modes: give --model "
                        "FILE.gguf (or no model: the embedded GGUF)")
    return found
