"""python -m mlx_flashnorm.convert: write a weightless FlashNorm checkpoint (Sec. 1, Fig. 1(b)).

Every pre-norm's weights are folded into the linears after it and set to 1; the final norm is
folded into the LM head, so a tied embedding is untied (lm_head is written and
tie_word_embeddings / share_input_output_layers set false). QK-norm weights (OpenELM) cannot be
folded into a linear (a per-head RMS sits between) and are kept. The output is the same Hugging
Face layout (config.json, model.safetensors, tokenizer files), in the source's dtype (--dtype), so
stock mlx-lm loads it unchanged and computes the same logits. A quantized source (e.g. the GGUF) is
dequantized; -q quantizes the folded weights (mlx-lm layout), which costs more quality than
quantizing unfolded ones (bench/RESULTS.md, "Perplexity")."""
import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from . import flashnorm, progress
from .cli import TOKENIZER_HELP, add_model_args
from .errors import HelpFormatter, UserError, run_cli
from .loader import (DTYPES, check_quantization, default_model_path, dequantize, load, quantize,
                     read_config, resolve)


def export(model, tokenizer, out):
    """Write model (its current weights and model.config) and tokenizer as an HF folder at out,
    atomically: everything goes to a temporary folder beside it that is renamed at the end."""
    out = Path(out)
    if out.exists():
        raise UserError(f"{out} already exists; choose a new --out folder (nothing is overwritten)")
    if not out.parent.is_dir():
        raise UserError(f"{out.parent}: no such folder; create it first or choose another --out")
    remove_stale_partials(out.parent)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        tmp.mkdir()
        (tmp / "config.json").write_text(json.dumps(model.config, indent=2) + "\n")
        mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())),
                            metadata={"format": "mlx"})
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        tmp.rename(out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"cannot write {out} ({e.strerror or e}); check the folder's space and "
                        "permissions")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


PARTIAL = re.compile(r"\..+\.partial-(\d+)")  # export's temporary folder: .NAME.partial-PID


def remove_stale_partials(folder):
    """Remove the temporary folders that exports killed mid-write (SIGKILL runs no cleanup) left in
    folder: those whose process is gone. A live process's folder, or another user's, stays."""
    for p in folder.iterdir():
        match = PARTIAL.fullmatch(p.name)
        if match and p.is_dir() and not _alive(int(match[1])):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid):
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process, or not a pid we can ask about: leave it
    return True


STAGES = ("loading", "folding the norms", "writing")  # what the progress bar names


def arg_parser():
    p = argparse.ArgumentParser(prog="python -m mlx_flashnorm.convert",
                                description=__doc__.split("\n\n")[1],
                                formatter_class=HelpFormatter)
    add_model_args(p, "--model", "--tokenizer",
                   tokenizer=dict(help=TOKENIZER_HELP + " (saved into the output)"))
    p.add_argument("--flashnorm", action="store_true",
                   help="fold the norm weights (the conversion done)")
    p.add_argument("--out", required=True, help="new output folder (must not exist)")
    p.add_argument("--dtype", choices=list(DTYPES),
                   help="dtype of the written weights (default: the source's; float16 for a GGUF)")
    p.add_argument("-q", "--quantize", action="store_true",
                   help="quantize the folded weights too (mlx-lm layout), as mlx_lm.convert -q "
                        "does")
    p.add_argument("--q-bits", type=int, default=4, help="bits per weight with -q")
    p.add_argument("--q-group-size", type=int, default=64, help="weights per scale/bias with -q")
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    return p


def source_dtype(model_path):
    """The dtype a checkpoint is stored in: config.json's dtype (transformers 5) or torch_dtype;
    float16 for a GGUF (its quantized blocks carry float16 scales)."""
    path = default_model_path() if model_path is None else resolve(model_path)
    if path.is_file():
        return "float16"
    config = read_config(path)
    dtype = config.get("dtype") or config.get("torch_dtype")
    return dtype if dtype in DTYPES else "float32"


def refuse_requantizing(quantization, model_path):
    """-q of a quantized source is refused as load's --bits is (loader.prepare): its weights would
    be rounded twice, and the model written answers worse than the source, silently."""
    source = model_path or "the embedded SmolLM2-135M-Instruct"
    raise UserError(f"{source} is already quantized ({quantization['bits']}-bit, group size "
                    f"{quantization['group_size']}); quantizing it again (-q) stacks two rounding "
                    "errors: convert it without -q (dequantized, written in --dtype), or start "
                    "from a full-precision checkpoint")


def main(argv=None):
    args = arg_parser().parse_args(argv)
    if not args.flashnorm:
        raise UserError("nothing to do: pass --flashnorm to write a weightless FlashNorm "
                        "checkpoint")
    out = Path(args.out)
    if out.exists():  # fail before loading the model
        raise UserError(f"{out} already exists; choose a new --out folder (nothing is overwritten)")
    if not out.parent.is_dir():
        raise UserError(f"{out.parent}: no such folder; create it first or choose another --out")
    if args.quantize:
        check_quantization(args.q_bits, args.q_group_size)
    dtype = args.dtype or source_dtype(args.model)
    with progress.bar(total=len(STAGES), desc="convert", unit="step") as bar:
        bar.set_postfix_str(STAGES[0])
        model, tokenizer = load(args.model, norm="rms", dtype="float32", tokenizer=args.tokenizer,
                                concat=False)
        bar.update()
        bar.set_postfix_str(STAGES[1])
        if "quantization" in model.config:
            if args.quantize:  # before anything is written
                refuse_requantizing(model.config["quantization"], args.model)
            dequantize(model)
        flashnorm.make_weightless(model)  # in float32, then stored as dtype
        model.set_dtype(DTYPES[dtype])
        dtype_key = "dtype" if "dtype" in model.config else "torch_dtype"
        model.config = dict(model.config, **{dtype_key: dtype})
        if args.quantize:
            quantize(model, args.q_bits, args.q_group_size)
        mx.eval(model.parameters())
        bar.update()
        bar.set_postfix_str(STAGES[2])
        out = export(model, tokenizer, args.out)
        bar.update()
    what = f", {args.q_bits}-bit, group size {args.q_group_size}" if args.quantize else ""
    print(f"wrote {out} ({dtype}{what})")


if __name__ == "__main__":
    sys.exit(run_cli(main))
