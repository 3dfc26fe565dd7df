"""The pre-tokenizer of a byte-level BPE GGUF, chosen by its `tokenizer.ggml.pre` (llama.cpp's name
for the model family's rule): how text is cut into pieces before the merges run. Families differ on
numbers (GPT-2: any run of digits; Llama 3: runs of at most three; Qwen 2 and SmolLM: one digit a
piece), on contractions (Llama 3 and Qwen 2 match them case-insensitively) and on what a leading
space or newline joins, so a wrong rule gives other token ids for the same text. Each rule here
is the one its model's Hugging Face tokenizer.json states, built with the `tokenizers` library."""
from tokenizers import Regex, normalizers, pre_tokenizers

from .errors import UserError

# The split patterns of the models' tokenizer.json files (a Split pre-tokenizer, "isolated").
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

GPT2_NAMES = ("gpt2", "gpt-2")  # llama.cpp writes "gpt-2"
KNOWN = ("llama-bpe", "qwen2", "smollm", *GPT2_NAMES)


def _byte_level(use_regex):
    """GPT-2's byte-to-character mapping; with use_regex also GPT-2's own split pattern."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _split(pattern):
    return pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)


def pre_tokenizer(name):
    """(normalizer or None, pre-tokenizer) for tokenizer.ggml.pre `name`. A file without the key
    (older converters) gets GPT-2's rule, as before llama.cpp recorded one."""
    if name is None or name in GPT2_NAMES:
        return None, _byte_level(True)
    if name == "smollm":  # GPT-2's rule after every digit is cut off on its own
        return None, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                              _byte_level(True)])
    if name == "llama-bpe":  # Llama 3
        return None, pre_tokenizers.Sequence([_split(LLAMA3_PATTERN), _byte_level(False)])
    if name == "qwen2":  # Qwen 2, 2.5 and 3 (Unicode NFC first)
        return normalizers.NFC(), pre_tokenizers.Sequence([_split(QWEN2_PATTERN),
                                                           _byte_level(False)])
    raise UserError(f"GGUF tokenizer.ggml.pre '{name}' is not a pre-tokenizer we know "
                    f"({', '.join(KNOWN)}); "
                    "pass the model's Hugging Face tokenizer with --tokenizer PATH_OR_REPO")
