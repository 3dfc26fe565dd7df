"""The flags the commands share, with mlx_lm.generate's names: the model flags every command
takes (all of them: generate, chat, server), the sampling flags of generate, chat and server."""
import argparse

from .decoding import MAX_SEED
from .errors import HelpFormatter
from .loader import DTYPE_CHOICES, NORMS, QUANT_BITS, QUANT_GROUP_SIZES

__all__ = ["HelpFormatter", "MAX_SEED", "add_generation_args", "add_model_args",
           "add_sampling_args"]


TOKENIZER_HELP = "tokenizer folder, repo id or sentencepiece .model file"

# flag -> add_argument keywords: the model flags every command takes from here, as generate, chat
# and server take them (all of them, in this order)
MODEL_FLAGS = {
    "--model": dict(help="HF model folder, HF repo id, or llama .gguf file "
                         "(default: embedded SmolLM2-135M-Instruct)"),
    "--tokenizer": dict(help=TOKENIZER_HELP
                        + " (needed for OpenELM: e.g. meta-llama/Llama-2-7b-hf)"),
    "--norm": dict(choices=NORMS, default="flash",
                   help="flash: FlashNorm (the same function as rms, exact); rms: the reference; "
                        "none: no norms (speed ceiling only, the text is meaningless)"),
    "--bits": dict(type=int, default=None,
                   help=f"quantize weights at load time ({', '.join(map(str, QUANT_BITS))}), or 0 "
                        "for full precision (dequantizes a quantized checkpoint); default: as the "
                        "checkpoint is (a k-quant GGUF: 4)"),
    "--group-size": dict(type=int, default=64,
                         help="weights per scale/bias with --bits: "
                              f"{', '.join(map(str, QUANT_GROUP_SIZES))}"),
    "--dtype": dict(choices=DTYPE_CHOICES, default="auto",
                    help="activation dtype; auto: float32 on the CPU, the checkpoint's half "
                         "precision on a GPU"),
    "--warmup": dict(action=argparse.BooleanOptionalAction,
                     help="play a short throwaway request after loading, so that the first "
                          "request finds the decode step and the kernels compiled (default: on a "
                          "GPU; not on the CPU, where it costs more than it saves once MLX's "
                          "kernel cache on disk is filled)"),
    "--chat-template": dict(help="a Jinja chat template, as a file or as the text itself, in place "
                                 "of the tokenizer's (a GGUF without one can then chat)"),
    "--verbose": dict(action="store_true", help="show tracebacks on errors"),
}


def add_model_args(p, *flags, **changes):
    """Add model flags to parser p: with no flags all of MODEL_FLAGS (generate, chat, server), else
    the flags named (e.g. "--model", "--bits") in that order; a command with flags of its own
    between them calls this once for each run of them. changes: per flag, by its attribute name
    (group_size for --group-size), the add_argument keywords in which the command's flag differs,
    e.g. bits=dict(default=4, help="...")."""
    names = {f.removeprefix("--").replace("-", "_"): f for f in flags or MODEL_FLAGS}
    if set(changes) - set(names):
        raise ValueError(f"changes for flags not added: {sorted(set(changes) - set(names))}")
    for name, flag in names.items():
        p.add_argument(flag, **{**MODEL_FLAGS[flag], **changes.get(name, {})})


def add_sampling_args(p):
    p.add_argument("--max-tokens", "-m", type=int, default=256, help="tokens to generate at most")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 is off")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the k likeliest tokens; 0 is off")
    p.add_argument("--seed", type=int, default=None,
                   help=f"random seed, 0 to {MAX_SEED} (default: random)")


def add_generation_args(p):
    """What generate and chat take beyond the shared sampling flags (mlx_lm.generate's names):
    min-p, a repetition penalty, and the eager path's rotating or quantized KV cache."""
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least this fraction as likely as the likeliest; 0 is off")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="divide (multiply, if negative) the logits of recent tokens by this; "
                        "1 is off")
    p.add_argument("--repetition-context-size", type=int, default=20,
                   help="how many recent tokens (prompt included) the repetition penalty looks at")
    p.add_argument("--max-kv-size", type=int, default=None,
                   help="keep at most this many positions in the KV cache (a rotating window; "
                        "decodes eagerly)")
    p.add_argument("--kv-bits", type=int, default=None,
                   help="quantize the KV cache to this many bits (mlx-lm's QuantizedKVCache; "
                        "decodes eagerly)")
    p.add_argument("--kv-group-size", type=int, default=64,
                   help="values per scale/bias with --kv-bits")
