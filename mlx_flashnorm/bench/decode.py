"""Prompt (pp) and decode (tg) throughput of each norm mode against mlx-lm, the paper's table.

Every mode runs in this one process on the same weights; after a warm-up round the modes take
turns, one generation each per round, the order rotating from round to round (rms flash mlx-lm,
flash mlx-lm rms, ...) so that drift of the machine, and the place in a round, hit them alike. A
ratio between two modes is the median of their ratios within each round: a lent GPU host's speed
moves far more within a run than within a round (bench/RESULTS.md, "How the bench measures").
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import forms, progress
from ..convert import export
from ..errors import UserError
from ..decoding import generate_step
from ..loader import DTYPES, build_model, load, model_args, prepare, read_config, read_safetensors

NORM_MODES = ("rms", "flash", "none")
PEER = "mlx-lm"
EAGER = "-eager"  # suffix: our runner without the compiled decode step, to measure that lever
# suffix: without the whole-step kernel (kernels.decode_layers), one per sublayer
SUBLAYER = "-sublayer"
# suffix: the prompt through the model's blocks, not the one-launch prefill (kernels.prefill_rows)
LOOP_PREFILL = "-loop-prefill"
# rms on the model's layer loop (MLX's primitives and the norm kernel), as rms ran before every
# mode took the whole-step kernels: the step from the primitives to the kernel, measured
PRIMITIVES = "rms-primitives"
# how this version measures (the settings line)
RATIOS = ", order rotating, ratios paired per round"

# apple/OpenELM-270M's config.json
OPENELM_270M = {
    "model_type": "openelm",
    "model_dim": 1280,
    "num_transformer_layers": 16,
    "head_dim": 64,
    "num_query_heads": [12, 12, 12, 12, 12, 16, 16, 16, 16, 16, 16, 16, 20, 20, 20, 20],
    "num_kv_heads": [3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5],
    "ffn_multipliers": [0.5, 0.73, 0.97, 1.2, 1.43, 1.67, 1.9, 2.13, 2.37, 2.6, 2.83, 3.07, 3.3,
                        3.53, 3.77, 4.0],
    "ffn_dim_divisor": 256,
    "ffn_with_glu": True,
    "normalize_qk_projections": True,
    "share_input_output_layers": True,
    "rope_freq_constant": 10000,
    "rope_max_length": 4096,
    "max_context_length": 2048,
    "vocab_size": 32000,
    "qkv_multipliers": [0.5, 1.0],
    "num_gqa_groups": 4,
    "normalization_layer_name": "rms_norm",
    "activation_fn_name": "swish",
}

# HuggingFaceTB/SmolLM2-135M's config.json: the Llama-family shape (Sec. 3 attention, SwiGLU mlp)
SMOLLM2_135M = {
    "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
    "rms_norm_eps": 1e-5, "rope_theta": 100000, "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
# meta-llama/Llama-3.2-1B's config.json: grouped-query attention, llama3 RoPE scaling, a large
# vocabulary
LLAMA_3_2_1B = {
    "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True,
}
SHAPES = {"openelm-270m": ("OpenELM-270M", OPENELM_270M),
          "smollm2-135m": ("SmolLM2-135M", SMOLLM2_135M),
          "llama-3.2-1b": ("Llama-3.2-1B", LLAMA_3_2_1B)}

# The same architecture shrunk so that every mode runs end to end in seconds (tests use it).
TINY = dict(OPENELM_270M, model_dim=128, num_transformer_layers=2, num_query_heads=[4, 4],
            num_kv_heads=[2, 1], ffn_multipliers=[0.5, 1.0], vocab_size=512,
            max_context_length=1024)


def random_weights(config, seed=0, scale=0.02):
    """Random float32 weights of config's architecture, keyed by checkpoint name: norm weights are
    drawn around 1 (as in a trained model) so that FlashNorm's folding has real work to do, the
    others with standard deviation `scale`."""
    arch, args = model_args(config)
    mx.random.seed(seed)
    weights = {}
    for name, p in tree_flatten(arch.Model(args).parameters()):
        weights[name] = (1.0 + 0.2 * mx.random.normal(p.shape)) if "norm" in name \
            else scale * mx.random.normal(p.shape)
    mx.eval(weights)
    return weights


def random_checkpoint(folder, config, seed=0):
    """Write config.json and random_weights(config, seed)."""
    weights = random_weights(config, seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    return folder


def gguf_checkpoint(path, folder, bits=None, group_size=64):
    """A GGUF file (None: the embedded SmolLM2) as load() reads it (norm rms, float32, the file's
    layout; bits 0 dequantizes, other bits are left to the modes' loaders) written to folder as a
    Hugging Face checkpoint, which every mode loads, mlx-lm's included. Returns (label, config)."""
    model, tokenizer = load(path, norm="rms", bits=0 if bits == 0 else None, group_size=group_size,
                            dtype="float32", progress=False, concat=False)
    export(model, tokenizer, folder)
    return Path(path).name if path else "embedded SmolLM2-135M-Instruct", model.config


def load_ours(folder, norm, bits, dtype, group_size):
    config = read_config(folder)
    model = build_model(config, read_safetensors(folder), progress=False)
    model.set_dtype(DTYPES[dtype])
    try:
        return prepare(model, norm=norm, bits=bits, group_size=group_size)
    except ImportError as e:
        raise UserError(f"mode '{norm}' is not available in this checkout ({e}); leave it out of "
                        "--modes")


def load_mlx_lm(folder, bits, dtype, group_size):
    """mlx-lm's own model class and quantization, on the same checkpoint."""
    from mlx_lm.utils import load_model, quantize_model

    model, config = load_model(Path(folder))
    model.set_dtype(DTYPES[dtype])
    if bits:
        model, _ = quantize_model(model, config, group_size, bits)
    mx.eval(model.parameters())
    return model


def our_runner(model, compiled, without=()):
    """Our generate_step on model; without: kernels kept off while it runs (forms.DISABLED)."""
    def run(prompt, max_tokens):
        with forms.without(*without):
            yield from generate_step(prompt, model, max_tokens=max_tokens, compiled=compiled)
    return run


def mlx_lm_runner(model):
    from mlx_lm.generate import generate_step as mlx_lm_generate_step

    def run(prompt, max_tokens):
        return mlx_lm_generate_step(prompt, model, max_tokens=max_tokens)  # greedy by default
    return run


def timed(run, prompt, max_tokens):
    """One generation: (seconds to the first token, seconds for the max_tokens - 1 after it)."""
    mx.synchronize()
    t0 = time.perf_counter()
    tokens = run(prompt, max_tokens)
    next(tokens)
    t1 = time.perf_counter()
    n = sum(1 for _ in tokens)
    t2 = time.perf_counter()
    if n != max_tokens - 1:
        raise RuntimeError(f"expected {max_tokens} tokens, got {n + 1}")
    return t1 - t0, t2 - t1


def measure(run, prompt, tg):
    """One generation: (pp tok/s, tg tok/s, peak memory GB). pp counts up to the first token;
    tg counts the tg - 1 tokens after it (as mlx-lm and stream_generate report them)."""
    mx.reset_peak_memory()
    first, rest = timed(run, prompt, tg)
    return prompt.size / first, (tg - 1) / rest, mx.get_peak_memory() / 1e9


def round_order(modes, rep):
    """The modes in the order round rep runs them: rotated by one place per round."""
    k = max(rep, 0) % len(modes)
    return modes[k:] + modes[:k]


def paired_ratio(xs, base):
    """xs against base: the median of the per-round ratios."""
    return statistics.median(x / b for x, b in zip(xs, base, strict=True))


def summary(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def device_name():
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    name = info.get("device_name") or info.get("name") or ""
    backend = "cuda" if mx.cuda.is_available() else ("metal" if mx.metal.is_available() else "cpu")
    return f"{backend}: {name}".strip(": ")


def mode_line(mode):
    """What a mode runs, in a few words (the table's footnote)."""
    if mode == PEER:
        return "mlx-lm's own model and generate_step on the same checkpoint"
    if mode == PRIMITIVES:
        return "RMSNorm on the layer loop (MLX's primitives and the norm kernel)"
    norm = mode.removesuffix(EAGER).removesuffix(SUBLAYER).removesuffix(LOOP_PREFILL)
    if norm not in NORM_MODES:  # a peer's rows added to the report (llama_bench)
        return "llama.cpp's llama-bench on the same GGUF file" if mode == "llama.cpp" else mode
    what = {"rms": "RMSNorm (1/RMS and the norm weights applied before each matvec)",
            "flash": "FlashNorm (norm weights folded or kept on the input, 1/RMS after the matvec)",
            "none": "no normalization (a speed ceiling)"}[norm]
    how = (" on the eager step" if mode.endswith(EAGER) else
           " on one kernel per sublayer" if mode.endswith(SUBLAYER) else
           " on the whole-step kernel, the prompt through the blocks"
           if mode.endswith(LOOP_PREFILL) else
           " on the whole-step kernel where our kernels run")
    return what + how


def code_path():
    """What our modes ran on: our kernels, MLX's primitives alone (the portable path, the stand-in
    for Metal), or the CPU."""
    if mx.default_device() == mx.cpu:
        return "CPU"
    return "MLX primitives only (portable)" if forms.portable() else "our kernels"


def parameter_count(weights, config):
    """The model's parameters from its checkpoint's arrays: a quantized weight (packed in uint32
    words, beside its scales) counts its unpacked values; scales and biases are not parameters."""
    q = config.get("quantization") or {}
    n = 0
    for name, v in weights.items():
        prefix = name.rsplit(".", 1)[0]
        if (name.endswith((".scales", ".biases")) and f"{prefix}.weight" in weights
                and f"{prefix}.scales" in weights):
            continue
        packed = v.dtype == mx.uint32 and f"{prefix}.scales" in weights
        bits = (q.get(prefix) or {}).get("bits", q.get("bits", 4)) if packed else None
        n += v.size * 32 // bits if packed else v.size
    return n


def bench(modes, folder, label, bits, dtype, pp, tg, reps, group_size=64, seed=0, log=print):
    config = read_config(folder)
    runners, sizes = {}, {}
    for mode in modes:
        if mode == PEER:
            model = load_mlx_lm(folder, bits, dtype, group_size)
            runners[mode] = mlx_lm_runner(model)
        else:
            norm = ("rms" if mode == PRIMITIVES else
                    mode.removesuffix(EAGER).removesuffix(SUBLAYER).removesuffix(LOOP_PREFILL))
            model = load_ours(folder, norm, bits, dtype, group_size)
            without = (("decode_layers", "decode_rows", "prefill_rows") if mode == PRIMITIVES
                       else ("decode_layers",) if mode.endswith(SUBLAYER)
                       else ("prefill_rows",) if mode.endswith(LOOP_PREFILL) else ())
            runners[mode] = our_runner(model, compiled=False if mode.endswith(EAGER) else None,
                                       without=without)
        sizes[mode] = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    files = list(folder.glob("*.safetensors"))
    n_params = parameter_count(mx.load(str(files[0])), config) if len(files) == 1 else None

    mx.random.seed(seed)
    prompt = mx.random.randint(0, config.get("vocab_size", 32000), (pp,))
    results = {m: {"pp": [], "tg": [], "peak_memory_gb": 0.0} for m in modes}
    for rep in range(-1, reps):  # rep -1: warm-up (compilation, caches), not counted
        for mode in round_order(modes, rep):
            p, t, mem = measure(runners[mode], prompt, tg)
            log(f"{'warm-up' if rep < 0 else f'rep {rep + 1}/{reps}'} {mode:>12}: "
                f"pp {p:9.2f} tok/s  tg {t:8.2f} tok/s")
            if rep >= 0:
                results[mode]["pp"].append(p)
                results[mode]["tg"].append(t)
                results[mode]["peak_memory_gb"] = max(results[mode]["peak_memory_gb"], mem)
    for r in results.values():
        r["pp_summary"], r["tg_summary"] = summary(r["pp"]), summary(r["tg"])
    for key, base in (("rms", results.get("rms")), ("mlx_lm", results.get(PEER))):
        for r in results.values():
            for test in ("pp", "tg"):
                r[f"{test}_vs_{key}"] = paired_ratio(r[test], base[test]) if base else None
    import mlx_lm

    saved = config.get("quantization") or {}  # a quantized checkpoint, used as it is
    return {
        "model": label, "params": n_params, "size_bytes": sizes, "device": device_name(),
        "path": code_path(), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "dtype": dtype,
        "bits": bits or saved.get("bits"),
        "group_size": group_size if bits else saved.get("group_size"), "pp": pp, "tg": tg,
        "reps": reps, "ratios": RATIOS,
        "command": "python -m mlx_flashnorm.bench " + " ".join(sys.argv[1:]), "results": results,
    }


def table(report):
    """Markdown in the style of llama-bench: one row per mode and test; where llama.cpp ran
    (llama_bench.add_to_report), its rows too and a column of our ratio to it."""
    bits = f"Q{report['bits']}" if report["bits"] else "full"
    params = f"{report['params'] / 1e6:.1f} M" if report["params"] else "?"
    peer = report.get("llama_bench")
    ratios = ["rms"] + ["llama_cpp"] * bool(peer)
    head = ["model", "size", "params", "mode", "test", "t/s (median)", "spread (min - max)",
            "vs rms", *["vs llama.cpp"] * bool(peer), "peak mem"]
    peer_line = [f"llama.cpp: `{peer['command']}`; vs llama.cpp: {peer['ratios']}"] if peer else []
    lines = [settings(report), *peer_line, "", "| " + " | ".join(head) + " |",
             "| --- | ---: | ---: | --- | --- |" + " ---: |" * (len(head) - 5)]
    for mode, r in report["results"].items():
        for test in ("pp", "tg"):
            s = r[f"{test}_summary"]
            cells = [f"{report['model']} {bits}", f"{report['size_bytes'][mode] / 2**20:.1f} MiB",
                     params, mode, f"{test}{report[test]}", f"{s['median']:.2f}",
                     f"{s['min']:.2f} - {s['max']:.2f}"]
            cells += ["-" if r.get(f"{test}_vs_{k}") is None else f"{r[f'{test}_vs_{k}']:.3f}"
                      for k in ratios]
            cells.append("-" if r["peak_memory_gb"] is None
                         else f"{r['peak_memory_gb'] * 1e3:.0f} MB")
            lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + [f"- {mode}: {mode_line(mode)}" for mode in report["results"]]
    return "\n".join(lines) + "\n"


COLORS = ["#4c72b0", "#dd8452", "#55a868", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]


def settings(report):
    """What every point of a run shares, in one line."""
    bits = f"Q{report['bits']}" if report["bits"] else "full"
    return (f"device: {report['device']} | {report.get('path', 'path not recorded')} | "
            f"MLX {report['mlx']} | mlx-lm {report['mlx_lm']} | activations {report['dtype']} | "
            f"weights {bits} | {report['reps']} reps, interleaved, after "
            f"warm-up{report.get('ratios', '')}")


def plot(reports, path):
    """Bar chart of median prefill (pp) and decode (tg) tok/s: a group of bars per report (one
    benchmark point), a bar per mode, whiskers from min to max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(m for r in reports for m in r["results"]))
    width = 0.8 / len(modes)
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 2.2 * len(reports)), 4.5))
    for ax, test, name in zip(axes, ("pp", "tg"), ("prefill", "decode")):
        for j, mode in enumerate(modes):
            points = [(i, r["results"][mode][f"{test}_summary"]) for i, r in enumerate(reports)
                      if mode in r["results"]]
            xs = [i + (j - (len(modes) - 1) / 2) * width for i, _ in points]
            med = [s["median"] for _, s in points]
            err = [[s["median"] - s["min"] for _, s in points],
                   [s["max"] - s["median"] for _, s in points]]
            ax.bar(xs, med, width, yerr=err, capsize=3, label=mode, color=COLORS[j % len(COLORS)])
            vs_peer = [r["results"][mode].get(f"{test}_vs_llama_cpp") for r in reports
                       if mode in r["results"]]
            # our ratio to llama.cpp, where it ran (llama_bench)
            for x, m, v in zip(xs, med, vs_peer):
                ax.annotate((f"{m:.0f}" if m >= 100 else f"{m:.1f}")
                            + ("" if v is None else f"\n{v:.2f}x"), (x, m),
                            ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(reports)), [f"{r['model'].removesuffix(' (random weights)')}\n"
                                            f"pp{r['pp']} tg{r['tg']}" for r in reports],
                      fontsize=8)
        peer_note = any("llama_bench" in r for r in reports)
        ax.set_title(f"{name} ({test}) tokens/s, higher is better"
                     + ("\n(and ours / llama.cpp's)" if peer_note else ""), fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(settings(reports[0]), fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def write_atomic(path, text):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def parse_modes(text):
    modes = [m.strip() for m in text.split(",") if m.strip()]
    valid = (NORM_MODES + tuple(m + EAGER for m in NORM_MODES)
             + ("flash" + SUBLAYER, "flash" + LOOP_PREFILL, PRIMITIVES, PEER))
    bad = [m for m in modes if m not in valid]
    if not modes or bad:
        raise UserError(f"unknown mode '{bad[0] if bad else text}'; --modes takes a "
                        f"comma-separated list of {', '.join(valid)}")
    if len(set(modes)) != len(modes):
        raise UserError("--modes lists a mode twice")
    return modes


def config_file(path):
    """(name, config) from a Hugging Face config.json, for random weights of its architecture."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{path}: no such file; --config takes a Hugging Face config.json")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{file}: invalid JSON ({e})")
    if not isinstance(config, dict) or "model_type" not in config:
        raise UserError(f"{file}: not a model's config.json (no model_type)")
    # the random weights are full precision; --bits quantizes them
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    try:
        model_args(config)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{file}: cannot build a model from it ({type(e).__name__}: {e})")
    name = str(config.get("_name_or_path", "")).rstrip("/").split("/")[-1] or \
        (file.resolve().parent.name if file.name == "config.json" else file.stem)
    return name, config


def shape(name):
    if name not in SHAPES:
        raise UserError(f"unknown shape '{name}'; --shape takes {', '.join(SHAPES)}")
    return SHAPES[name]


def random_shape(args):
    """(name, config) of the random-weight model that --shape, --config or --tiny choose."""
    if args.config and len(args.config) > 1:
        raise UserError("--config is given twice; only --matrix takes several")
    if args.tiny:
        return "tiny OpenELM", TINY
    return config_file(args.config[0]) if args.config else shape(args.shape or "openelm-270m")


def context_length(config):
    return model_args(config)[1].context_length


def check_context(name, config, pp, tg):
    ctx = context_length(config)
    if pp + tg > ctx:
        raise UserError(f"{name}: --pp + --tg is {pp + tg}, the model's context is {ctx}: "
                        "lower them")


def positive(text, what):
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise UserError(f"{what} takes whole numbers of at least 1, not '{text}'")
    return n


def log(text):
    progress.write(text)
