"""Validation of a GGUF file at the boundary, before any tensor is read: the header's structure
(what gguf._Header parses: version, alignment, counts), the tensor directory (every tensor's byte
range inside the data section, aligned, of the size its type and shape imply, overlapping none)
and the metadata values the loader reads (positive sizes, heads that divide the weights, a
plausible context length, token ids inside the vocabulary). Every failure is a UserError naming
the file and the field, so that a damaged file is refused instead of loading into a model that
computes garbage.
"""
import math

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import UserError
from .validate import MAX_CONTEXT, MAX_LAYERS

VERSIONS = (2, 3)  # the GGUF versions the format defines (1 is obsolete, with 32-bit counts)
MAX_DIMS = 4  # GGML_MAX_DIMS: a tensor has 1 to 4 dimensions
MAX_NESTING = 4  # arrays of arrays: no model uses more than 2 levels
MAX_KEY = 65535  # bytes of a metadata key (GGUF's limit)
MAX_TENSOR_NAME = 256  # bytes of a tensor name (llama.cpp allows 63)
CORRUPT = "the file is truncated or corrupt"

# Metadata of the architecture (prefixed with its name, e.g. "llama.") that the loader reads as
# positive whole numbers, and as positive finite numbers.
POSITIVE_INTS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                 "attention.head_count_kv", "context_length", "vocab_size", "rope.dimension_count",
                 "attention.key_length", "attention.value_length", "attention.sliding_window")
POSITIVE_FLOATS = ("rope.freq_base", "attention.layer_norm_rms_epsilon", "rope.scaling.factor")
TOKEN_IDS = ("bos", "eos", "unknown", "padding")  # tokenizer.ggml.<name>_token_id


def alignment(meta):
    """general.alignment (32 when absent): a power of two, or ValueError naming the field."""
    align = meta.get("general.alignment", 32)
    if not _is_int(align) or align <= 0 or align & (align - 1):
        raise ValueError(f"metadata 'general.alignment' is {align!r}, not a positive power of two")
    return int(align)


def check_version(version):
    if version not in VERSIONS:
        endian = " (a big-endian file?)" if version > 0xFFFF else ""
        raise ValueError(f"GGUF version {version} is not one of "
                         f"{', '.join(map(str, VERSIONS))}{endian}")


def check_count(what, n, min_bytes, remaining):
    """A count read from the file that cannot be right: more items than bytes left to hold them."""
    if n * min_bytes > remaining:
        raise ValueError(f"{what} is {n}, more than the {remaining} bytes left can hold")


def check(header, path):
    """The tensor directory and the metadata of a parsed header (gguf._Header)."""
    _check_tensors(header, path)
    _check_metadata(header.meta, {name: shape for name, shape, _, _ in header.tensors}, path)


def nbytes(shape, kind):
    """Bytes of a tensor of GGUF type number kind and shape (numpy order), or None when the row
    width is not a whole number of the type's blocks."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    if shape[-1] % block:
        return None
    return math.prod(shape) // block * size


def _check_tensors(header, path):
    names, spans = set(), []
    data_bytes = len(header.buf) - header.data_start
    align = alignment(header.meta)
    known = set(GGMLQuantizationType)
    for name, shape, kind, offset in header.tensors:
        where = f"{path}: tensor '{name}'"
        if name in names:
            raise UserError(f"{where} appears twice in the tensor directory; {CORRUPT}")
        names.add(name)
        if kind not in known:
            raise UserError(f"{where}: unknown GGUF tensor type {kind} (newer than the gguf "
                            "package knows, or damaged); upgrade gguf or use a file of another "
                            "type (e.g. Q8_0)")
        if not 1 <= len(shape) <= MAX_DIMS or min(shape) < 1:
            raise UserError(f"{where} has shape {list(shape)}: every tensor has 1 to {MAX_DIMS} "
                            f"dimensions of at least 1; {CORRUPT}")
        size = nbytes(shape, kind)
        qtype = GGMLQuantizationType(kind).name
        if size is None:
            raise UserError(f"{where} ({qtype}) has rows of {shape[-1]} values, not a whole "
                            f"number of {qtype} blocks; {CORRUPT}")
        if offset % align:
            raise UserError(f"{where}: data offset {offset} is not a multiple of the alignment "
                            f"{align}; {CORRUPT}")
        if offset + size > data_bytes:
            raise UserError(f"{where} ({qtype}, shape {list(shape)}) ends "
                            f"{offset + size - data_bytes} bytes beyond the end of the file; "
                            f"{CORRUPT}")
        spans.append((offset, size, name, qtype))
    spans.sort()
    _check_ends(spans, data_bytes, align, path)
    for (start, size, name, qtype), (nxt, _, other, _) in zip(spans, spans[1:]):
        padded = -(-(start + size) // align) * align
        if padded != nxt:  # writers pack tensors back to back, each padded to the alignment
            how = "overlaps" if start + size > nxt else "leaves a gap before"
            raise UserError(f"{path}: tensor '{name}' ({qtype}, {size} bytes at offset {start}) "
                            f"{how} tensor '{other}' at offset {nxt}: its type or shape does not "
                            f"match the data; {CORRUPT}")


def _check_ends(spans, data_bytes, align, path):
    """The data section starts with a tensor and ends with one (and its padding): else the header's
    end, and so the data start, is not where the writer put it (a wrong count, a wrong length)."""
    if not spans:
        return
    (first, _, name, _), (last, size, other, _) = spans[0], spans[-1]
    if first != 0:
        raise UserError(f"{path}: the data section starts {first} bytes before its first tensor "
                        f"'{name}'; the header's counts or lengths are wrong; {CORRUPT}")
    if data_bytes - (last + size) >= align:
        raise UserError(f"{path}: {data_bytes - (last + size)} bytes follow the last tensor "
                        f"'{other}'; the header's counts or lengths are wrong; {CORRUPT}")


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _check_metadata(meta, shapes, path):
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        if arch is not None:
            raise UserError(f"{path}: GGUF metadata 'general.architecture' is {arch!r}, "
                            f"not a name; {CORRUPT}")
        return
    p = arch + "."
    for suffix in POSITIVE_INTS:
        v = meta.get(p + suffix)
        if v is not None and (not _is_int(v) or v <= 0):
            raise UserError(f"{path}: GGUF metadata '{p + suffix}' must be a positive whole "
                            f"number, not {_show(v)}; {CORRUPT}")
    for suffix in POSITIVE_FLOATS:
        v = meta.get(p + suffix)
        if v is not None and (not isinstance(v, float) or not math.isfinite(v) or v <= 0):
            raise UserError(f"{path}: GGUF metadata '{p + suffix}' must be a positive float, "
                            f"not {_show(v)}; {CORRUPT}")
    if meta.get(p + "block_count", 0) > MAX_LAYERS:
        raise UserError(f"{path}: GGUF metadata '{p}block_count' is {meta[p + 'block_count']}, "
                        f"beyond any model's (at most {MAX_LAYERS}); {CORRUPT}")
    context = meta.get(p + "context_length")
    if context is not None and context > MAX_CONTEXT:
        raise UserError(f"{path}: GGUF metadata '{p}context_length' is {context}, beyond any "
                        f"model's context (at most {MAX_CONTEXT}); {CORRUPT}")
    _check_shapes(meta, p, shapes, path)
    _check_tokenizer(meta, shapes, path)


def _check_shapes(meta, p, shapes, path):
    """The architecture's sizes against the tensors they describe (numpy order: rows first)."""
    embd = shapes.get("token_embd.weight")
    hidden = meta.get(p + "embedding_length")
    if embd is not None and hidden is not None and embd[-1] != hidden:
        raise UserError(f"{path}: GGUF metadata '{p}embedding_length' is {hidden}, but "
                        f"token_embd.weight has rows of {embd[-1]}; {CORRUPT}")
    heads = meta.get(p + "attention.head_count")
    kv = meta.get(p + "attention.head_count_kv", heads)
    if heads is None:
        return
    if heads % kv:
        raise UserError(f"{path}: GGUF metadata '{p}attention.head_count' ({heads}) is not a "
                        f"multiple of '{p}attention.head_count_kv' ({kv}); {CORRUPT}")
    # llama.cpp interleaves RoPE pairs within each head: every head has an even number of rows
    for tensor, n, key in (("attn_q", heads, "head_count"), ("attn_k", kv, "head_count_kv")):
        shape = shapes.get(f"blk.0.{tensor}.weight")
        if shape is not None and (len(shape) != 2 or shape[0] % (2 * n)):
            raise UserError(f"{path}: GGUF metadata '{p}attention.{key}' ({n}) does not divide the "
                            f"{shape[0]} rows of blk.0.{tensor}.weight into heads; {CORRUPT}")
    q = shapes.get("blk.0.attn_q.weight")
    for key in ("attention.key_length", "rope.dimension_count"):  # the head size, where stated
        if q is not None and meta.get(p + key) is not None:
            if meta[p + key] * heads != q[0]:
                raise UserError(f"{path}: GGUF metadata '{p}{key}' ({meta[p + key]}) times the "
                                f"{heads} heads is not the {q[0]} rows of blk.0.attn_q.weight; "
                                f"{CORRUPT}")
            break


def _check_tokenizer(meta, shapes, path):
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        return
    field = f"{path}: GGUF metadata 'tokenizer.ggml."
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise UserError(f"{field}tokens' is not a list of token strings; {CORRUPT}")
    embd = shapes.get("token_embd.weight")
    if embd is not None and len(tokens) > embd[0]:
        raise UserError(f"{field}tokens' has {len(tokens)} tokens, but token_embd.weight only "
                        f"{embd[0]} rows; {CORRUPT}")
    for key in ("token_type", "scores"):
        values = meta.get(f"tokenizer.ggml.{key}")
        if values is not None and (not isinstance(values, np.ndarray)
                                   or values.shape != (len(tokens),)):
            raise UserError(f"{field}{key}' does not hold one number for each of the "
                            f"{len(tokens)} tokens; {CORRUPT}")
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None and (not isinstance(merges, list) or
                               not all(isinstance(m, str) and " " in m for m in merges)):
        raise UserError(f"{field}merges' is not a list of 'left right' merge strings; {CORRUPT}")
    for name in TOKEN_IDS:
        i = meta.get(f"tokenizer.ggml.{name}_token_id")
        if i is not None and (not _is_int(i) or not 0 <= i < len(tokens)):
            raise UserError(f"{field}{name}_token_id' is {_show(i)}, outside the vocabulary of "
                            f"{len(tokens)} tokens; {CORRUPT}")
    for key in ("model", "pre", "chat_template"):
        v = meta.get(("tokenizer." if key == "chat_template" else "tokenizer.ggml.") + key)
        if v is not None and not isinstance(v, str):
            name = "tokenizer.chat_template" if key == "chat_template" else f"tokenizer.ggml.{key}"
            raise UserError(f"{path}: GGUF metadata '{name}' is {_show(v)}, not a string; "
                            f"{CORRUPT}")


def _show(v):
    """A metadata value for a message: arrays and long lists by their length only."""
    if isinstance(v, (list, np.ndarray)):
        return f"an array of {len(v)} values"
    text = repr(v.item() if hasattr(v, "item") else v)
    return text if len(text) <= 40 else text[:37] + "..."
