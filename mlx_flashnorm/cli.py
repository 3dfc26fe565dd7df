"""The flags the model-running commands share (generate, chat, server), with mlx_lm.generate's
names."""
import argparse

from .decoding import MAX_SEED
from .errors import HelpFormatter
from .loader import DTYPE_CHOICES, NORMS, QUANT_BITS, QUANT_GROUP_SIZES

__all__ = ["HelpFormatter", "MAX_SEED", "add_generation_args", "add_model_args", "add_sampling_args"]


def add_model_args(p):
    """The model flags every command shares (generate, chat, server)."""
    p.add_argument("--model", help="HF model folder, HF repo id, or llama .gguf file "
                                   "(default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tokenizer", help="tokenizer folder, repo id or sentencepiece .model file "
                                       "(needed for OpenELM: e.g. meta-llama/Llama-2-7b-hf)")
    p.add_argument("--norm", choices=NORMS, default="flash",
                   help="flash: FlashNorm (the same function as rms, exact); rms: the reference; none: "
                        "no norms (speed ceiling only, the text is meaningless)")
    p.add_argument("--bits", type=int, default=None,
                   help=f"quantize weights at load time ({', '.join(map(str, QUANT_BITS))}), or 0 for full "
                        "precision (dequantizes a quantized checkpoint); default: as the checkpoint is "
                        "(a k-quant GGUF: 4)")
    p.add_argument("--group-size", type=int, default=64,
                   help=f"weights per scale/bias with --bits: {', '.join(map(str, QUANT_GROUP_SIZES))}")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="activation dtype; auto: float32 on the CPU, the checkpoint's half precision on a GPU")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction,
                   help="play a short throwaway request after loading, so that the first request finds "
                        "the decode step and the kernels compiled (default: on a GPU; not on the CPU, "
                        "where it costs more than it saves once MLX's kernel cache on disk is filled)")
    p.add_argument("--chat-template", help="a Jinja chat template, as a file or as the text itself, in "
                                           "place of the tokenizer's (a GGUF without one can then chat)")
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")


def add_sampling_args(p):
    p.add_argument("--max-tokens", "-m", type=int, default=256, help="tokens to generate at most")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 is off")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 is off")
    p.add_argument("--seed", type=int, default=None, help=f"random seed, 0 to {MAX_SEED} (default: random)")


def add_generation_args(p):
    """What generate and chat take beyond the shared sampling flags (mlx_lm.generate's names): min-p,
    a repetition penalty, and the eager path's rotating or quantized KV cache."""
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least this fraction as likely as the likeliest; 0 is off")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="divide (multiply, if negative) the logits of recent tokens by this; 1 is off")
    p.add_argument("--repetition-context-size", type=int, default=20,
                   help="how many recent tokens (prompt included) the repetition penalty looks at")
    p.add_argument("--max-kv-size", type=int, default=None,
                   help="keep at most this many positions in the KV cache (a rotating window; decodes "
                        "eagerly)")
    p.add_argument("--kv-bits", type=int, default=None,
                   help="quantize the KV cache to this many bits (mlx-lm's QuantizedKVCache; decodes "
                        "eagerly)")
    p.add_argument("--kv-group-size", type=int, default=64, help="values per scale/bias with --kv-bits")
