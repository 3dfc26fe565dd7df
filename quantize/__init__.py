"""Write a quantized (or full-precision) checkpoint in the mlx-lm layout.

With --norm flash the checkpoint is FlashNorm's weightless form, so the order is fixed: fold in
full precision, then quantize W*g. That is the only form a stock loader runs, and it costs quality
at low bits (bench/RESULTS.md, "Perplexity"); load(..., norm="flash", bits=...) does not fold and
has no such cost. The checkpoint records its quantization in config.json as mlx-lm does, so our
load() and stock mlx-lm (mlx_lm.utils.load_model) read it back as it is, without quantizing again.
"""
import json
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import UserError
from ..loader import check_quantization, dequantize, load, prepare


def save(model, tokenizer, out):
    """Write model (weights + config.json) and tokenizer to the new folder out, atomically: all is
    written to a temporary folder beside it, which is renamed into place at the end."""
    out = Path(out)
    if out.exists():
        raise UserError(f"{out} already exists: pass a new --out folder (nothing was overwritten)")
    if not out.parent.is_dir():
        raise UserError(f"{out.parent}: no such folder for --out; create it first")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        weights = dict(tree_flatten(model.parameters()))
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        config = dict(sorted(model.config.items()))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(out)  # fails rather than replace a folder created meanwhile
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def quantize_checkpoint(model_path, out, bits=4, group_size=64, norm="rms", head_bits=None,
                        tokenizer=None, dequantize_first=False, progress=True):
    """Load model_path, fold the norm mode, quantize (bits 0: keep full precision) and save to out.

    norm "flash" saves FlashNorm's weightless form (Fig. 1(b)): norm weights folded into the
    linears they feed and set to 1, the final norm folded into an (untied) LM head; a plain
    checkpoint that any loader of the architecture runs, stock mlx-lm included. Quantized, it
    loses more than norm "rms" does (the folded weights quantize worse).

    An already quantized input is refused unless dequantize_first (its rounding error stays in).
    Returns the path written."""
    out = Path(out)
    if out.exists():  # fail before the (slow) load
        raise UserError(f"{out} already exists: pass a new --out folder (nothing was overwritten)")
    if bits:
        check_quantization(bits, group_size)
    model, tok = load(model_path, tokenizer=tokenizer, progress=progress, concat=False)  # as saved
    if "quantization" in model.config:
        if not dequantize_first and bits != 0:
            q = model.config["quantization"]
            raise UserError(f"{model_path or 'the default model'} is already quantized ({q['bits']}-bit, "
                            f"group size {q['group_size']}): pass --dequantize to dequantize it first "
                            "(its rounding error stays), or quantize a full-precision checkpoint")
        dequantize(model)
    if norm == "flash":  # folded in full precision, kept in the reference structure
        from .. import flashnorm

        flashnorm.make_weightless(model)
    elif norm != "rms":
        raise UserError(f"norm must be rms or flash for a saved checkpoint, not '{norm}'")
    prepare(model, bits=bits, group_size=group_size, head_bits=head_bits, concat=False)
    return save(model, tok, out)
