"""GGUF files: tensors of every type (read_tensors), and llama GGUF metadata -> HF config,
tensors -> HF names, tokenizer from metadata (read_gguf).

Files whose tensors are all F32, F16, Q4_0, Q4_1 or Q8_0 load through MLX's own GGUF reader; the
quantized tensors arrive in MLX's quantized layout (weight, scales, biases, groups of 32) and are
kept as they are. Any other file (k-quants such as Q4_K_M, Q5_0, BF16, i-quants, ...) is read here
and each tensor dequantized by the `gguf` package, then kept in float32 or quantized to MLX's
format. llama.cpp stores q/k projections with their rows permuted for the interleaved RoPE layout;
we permute them back so the model is an ordinary HF Llama.
"""
import mmap
import struct

import gguf
import mlx.core as mx
import numpy as np
from gguf.constants import GGML_QUANT_SIZES

from . import validate, validate_gguf
from .errors import UserError
from .models import GGUF_ARCHITECTURES, llama
from .pretokenizers import pre_tokenizer

MLX_TYPES = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}  # what mx.load reads exactly
_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                "I16": np.int16, "I32": np.int32, "I64": np.int64}  # stored unquantized
# GGUF metadata value types: struct format of each scalar; 8 is a string, 9 an array.
_U64 = struct.Struct("<Q")
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}


class _Header:
    """Metadata and tensor directory of a GGUF file (GGUF v2/v3 layout, little-endian)."""

    def __init__(self, path):
        with validate.open_file(path) as f:  # a regular file only (a FIFO: never waited on)
            try:
                self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except OSError as e:  # ENOMEM: no address space left for the file (ulimit -v)
                raise UserError(f"{path}: cannot map the file into memory ({e.strerror}): the "
                                "process is out of address space; raise its limit (ulimit -v) "
                                "or free memory") from None
        self.pos = 4
        if self.buf[:4] != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        version, n_tensors, n_kv = self._read("<IQQ")
        validate_gguf.check_version(version)
        validate_gguf.check_count("the metadata count", n_kv, 13, self._left())
        self.meta = {}
        for _ in range(n_kv):
            key = self._name("a metadata key", validate_gguf.MAX_KEY)
            if key in self.meta:
                raise ValueError(f"metadata key '{key}' appears twice")
            self.meta[key] = self._value(self._read("<I")[0], key)
        validate_gguf.check_count("the tensor count", n_tensors, 32, self._left())
        self.tensors = []  # (name, shape in numpy order, type number, offset from the data start)
        for _ in range(n_tensors):
            name = self._name("a tensor name", validate_gguf.MAX_TENSOR_NAME)
            n_dims = self._read("<I")[0]
            if n_dims > validate_gguf.MAX_DIMS:
                raise ValueError(f"tensor '{name}' has {n_dims} dimensions, "
                                 f"more than GGUF's {validate_gguf.MAX_DIMS}")
            dims = self._read(f"<{n_dims}Q")
            kind, offset = self._read("<IQ")
            self.tensors.append((name, tuple(reversed(dims)), kind, offset))
        align = validate_gguf.alignment(self.meta)
        self.data_start = -(-self.pos // align) * align

    def _left(self):
        return len(self.buf) - self.pos

    def _read(self, fmt):
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def _name(self, what, limit):
        """A key or a tensor name: printable text of at most limit bytes (so that a damaged length
        neither reads megabytes nor puts them into a message)."""
        n = struct.unpack_from("<Q", self.buf, self.pos)[0]
        if n > limit:
            raise ValueError(f"{what} at byte {self.pos} is {n} bytes long, "
                             f"more than GGUF allows ({limit})")
        try:
            name = bytes(self.buf[self.pos + 8:self.pos + 8 + n]).decode("utf-8")
        except UnicodeDecodeError:
            name = None
        if not name or not name.isprintable() or len(name.encode()) != n:
            raise ValueError(f"{what} at byte {self.pos} is not text")
        self.pos += 8 + n
        return name

    def _string(self):
        n = self._read("<Q")[0]
        self.pos += n
        if self.pos > len(self.buf):
            raise ValueError("the file ends inside its header")
        return self.buf[self.pos - n:self.pos].decode("utf-8", errors="replace")

    def _strings(self, n):
        """n strings: _string's loop inlined (a vocabulary holds 50k-250k of them)."""
        buf, pos, end, length = self.buf, self.pos, len(self.buf), _U64.unpack_from
        out = []
        for _ in range(n):
            k = length(buf, pos)[0]
            pos += 8 + k
            if pos > end:
                raise ValueError("the file ends inside its header")
            out.append(buf[pos - k:pos].decode("utf-8", errors="replace"))
        self.pos = pos
        return out

    def _value(self, kind, key, depth=0):
        if kind == 8:
            return self._string()
        if kind == 9:
            item, n = self._read("<IQ")
            if depth >= validate_gguf.MAX_NESTING:
                raise ValueError(f"metadata '{key}' nests arrays more than "
                                 f"{validate_gguf.MAX_NESTING} deep")
            if item in _SCALARS:
                dtype = np.dtype("<" + _SCALARS[item])
                validate_gguf.check_count(f"the length of metadata array '{key}'", n,
                                          dtype.itemsize, self._left())
                values = np.frombuffer(self.buf, dtype, n, self.pos).copy()
                self.pos += n * dtype.itemsize
                return values
            validate_gguf.check_count(f"the length of metadata array '{key}'", n, 8, self._left())
            if item == 8:
                return self._strings(n)
            return [self._value(item, key, depth + 1) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"metadata '{key}' has unknown value type {kind}")
        return self._read("<" + _SCALARS[kind])[0]


def read_tensors(path, bits=None, group_size=64):
    """Every tensor of a GGUF file, by GGUF name: (tensors, metadata, dequantized).

    A file MLX reads itself (all tensors F32, F16, Q4_0, Q4_1 or Q8_0) comes back as mx.load gives
    it: quantized tensors in MLX's layout (name.weight, .scales, .biases, groups of 32) and bits is
    ignored; dequantized is []. Any other file is read with the gguf package: every tensor is
    dequantized to float32, then those the file stored quantized (2-D, width a multiple of
    group_size) are quantized to MLX's format with `bits` (None: 4; 0: kept in float32).
    dequantized names the GGUF types that were dequantized. Metadata values are Python scalars,
    strings, lists of strings or numpy arrays. Unreadable files and types raise UserError."""
    try:
        header = _Header(str(path))
    except (ValueError, struct.error, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read GGUF file ({e}); it is truncated or corrupt")
    validate_gguf.check(header, path)  # the tensor directory and the metadata, before any data
    types = {name: gguf.GGMLQuantizationType(kind).name for name, _, kind, _ in header.tensors}
    if set(types.values()) <= MLX_TYPES:
        try:
            tensors = mx.load(str(path))
        except Exception as e:  # MLX raises plain exceptions for unreadable files
            raise UserError(f"{path}: cannot read GGUF file ({e}); it may be truncated or corrupt")
        return tensors, header.meta, []  # the metadata validate_gguf checked
    # before decoding anything
    for kind, name in {kind: name for name, kind in types.items()}.items():
        _check_readable(path, name, gguf.GGMLQuantizationType[kind])
    bits = 4 if bits is None else bits
    tensors = {}
    for name, shape, kind, offset in header.tensors:
        w = _dequantize(header, shape, kind, offset)
        quantized = types[name] not in _FLOAT_TYPES and types[name] != "BF16"
        if bits and quantized and w.ndim == 2 and w.shape[1] % group_size == 0:
            stem = name[: -len(".weight")] if name.endswith(".weight") else name
            w, scales, biases = mx.quantize(mx.array(w), group_size=group_size, bits=bits)
            tensors.update({f"{stem}.weight": w, f"{stem}.scales": scales,
                            f"{stem}.biases": biases})
        else:
            tensors[name] = mx.array(w)
    dequantized = sorted({t for t in types.values() if t not in ("F32", "F16")})
    return tensors, header.meta, dequantized


def _dequantize(header, shape, kind, offset):
    """One tensor as a float32 numpy array (the gguf package decodes the quantized types); its
    byte range was checked by validate_gguf.check."""
    qtype = gguf.GGMLQuantizationType(kind)
    rows = int(np.prod(shape[:-1]))
    raw = np.frombuffer(header.buf, np.uint8, validate_gguf.nbytes(shape, kind),
                        header.data_start + offset)
    if qtype.name in _FLOAT_TYPES:
        return raw.view(_FLOAT_TYPES[qtype.name]).reshape(shape).astype(np.float32)
    return gguf.quants.dequantize(raw.reshape(rows, -1), qtype).reshape(shape)


def _check_readable(path, name, qtype):
    if qtype.name in _FLOAT_TYPES:
        return
    try:
        gguf.quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        raise UserError(f"{path}: tensor '{name}' has GGUF type {qtype.name}, which cannot be read "
                        "(the gguf package does not decode it); use a file of another type "
                        "(e.g. Q4_K_M, Q8_0)")


def _scalar(meta, key, default=None):
    if key not in meta:
        if default is None:
            raise UserError(f"GGUF metadata lacks '{key}': the file is not a complete llama model")
        return default
    v = meta[key]
    return v.item() if hasattr(v, "item") else v


def _unpermute_rows(w, n_heads):
    """Undo llama.cpp's q/k row permutation (interleaved -> rotate-half RoPE layout).
    Rows are output channels, so packed quantized weights, scales and biases permute alike."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path, bits=None, group_size=64):
    """Return (config, weights, metadata, dequantized) for a llama GGUF, with HF tensor names and
    config keys; bits, group_size and dequantized as read_tensors has them. Other architectures are
    mapped by their model file (models/*.py: GGUF_ARCHITECTURE and from_gguf)."""
    tensors, meta, dequantized = read_tensors(path, bits, group_size)
    arch = _scalar(meta, "general.architecture", "unknown")
    if arch != "llama":
        if arch not in GGUF_ARCHITECTURES:
            raise UserError(f"{path}: GGUF architecture '{arch}' is not supported; GGUF files of "
                            f"{', '.join(['llama', *GGUF_ARCHITECTURES])} load")
        try:
            config, weights = GGUF_ARCHITECTURES[arch].from_gguf(tensors,
                                                                 lambda *a: _scalar(meta, *a))
        except UserError as e:
            raise UserError(f"{path}: {e}") from None
        return (_with_quantization(config, weights, group_size if dequantized else 32), weights,
                meta, dequantized)
    p = "llama."
    n_heads = int(_scalar(meta, p + "attention.head_count"))
    n_kv = int(_scalar(meta, p + "attention.head_count_kv", n_heads))
    hidden = int(_scalar(meta, p + "embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens", [])
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, p + "block_count")),
        "intermediate_size": int(_scalar(meta, p + "feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": int(_scalar(meta, p + "rope.dimension_count", hidden // n_heads)),
        "rms_norm_eps": float(_scalar(meta, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_scalar(meta, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_scalar(meta, p + "context_length", 2048)),
        "vocab_size": int(_scalar(meta, p + "vocab_size", len(tokens) or None)),
        "tie_word_embeddings": not any(k.startswith("output.") for k in tensors),
        "bos_token_id": _scalar(meta, "tokenizer.ggml.bos_token_id", -1),
        "eos_token_id": _scalar(meta, "tokenizer.ggml.eos_token_id", -1),
    }
    try:
        if scaling := llama.gguf_rope_scaling(lambda *a: _scalar(meta, *a), "llama",
                                              "rope_freqs.weight" in tensors):
            config["rope_scaling"] = scaling
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    weights = {}
    for name, w in tensors.items():
        hf = llama.gguf_name(name)
        if ".q_proj." in hf:
            w = _unpermute_rows(w, n_heads)
        elif ".k_proj." in hf:
            w = _unpermute_rows(w, n_kv)
        weights[hf] = w
    return (_with_quantization(config, weights, group_size if dequantized else 32), weights, meta,
            dequantized)


def _with_quantization(config, weights, group_size):
    quant = _quantization(weights, group_size)
    return dict(config, quantization=quant) if quant else config


def _quantization(weights, group_size):
    """mlx-lm style quantization entry: the common (group_size, bits) plus per-module overrides."""
    per_module = {}
    for key, scales in weights.items():
        if key.endswith(".scales"):
            mod = key[: -len(".scales")]
            packed = weights[mod + ".weight"].shape[-1]
            in_features = scales.shape[-1] * group_size
            per_module[mod] = {"group_size": group_size, "bits": packed * 32 // in_features}
    if not per_module:
        return None
    common = max(per_module.values(), key=list(per_module.values()).count)
    quant = dict(common)
    quant.update({m: q for m, q in per_module.items() if q != common})
    return quant


def gguf_tokenizer(meta):
    """A tokenizer built from GGUF metadata: a transformers fast tokenizer (GPT-2 style byte-level
    BPE), or a SentencePieceTokenizer (a SentencePiece vocabulary with scores)."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        # mlx-lm's TokenizerWrapper takes a class with an apply_chat_template of its own for a
        # custom chat renderer; this one has none, so it gets the Hugging Face one (never called).
        SentencePieceTokenizer.apply_chat_template = PreTrainedTokenizerFast.apply_chat_template
        return SentencePieceTokenizer(meta)
    if kind != "gpt2":
        raise UserError(f"GGUF tokenizer type '{kind}' is not supported; "
                        "pass --tokenizer PATH_OR_REPO")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    # the model family's rule
    normalizer, tok.pre_tokenizer = pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    types = (meta["tokenizer.ggml.token_type"].tolist() if "tokenizer.ggml.token_type" in meta
             else [])
    special = [tokens[i] for i, t in enumerate(types) if t == 3]  # 3 = control token

    def token(key):
        i = _scalar(meta, key, -1)
        return tokens[i] if 0 <= i < len(tokens) else None

    bos = token("tokenizer.ggml.bos_token_id")
    if bos is not None and _scalar(meta, "tokenizer.ggml.add_bos_token", False):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokens.index(bos))])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        additional_special_tokens=special,
        chat_template=meta.get("tokenizer.chat_template"),
    )
    return hf


class SentencePieceTokenizer:
    """The tokenizer of a GGUF with a SentencePiece vocabulary (tokenizer.ggml.model 'llama':
    pieces with scores and types, byte fallback), run by the sentencepiece library from a model
    proto built from that metadata. It offers what mlx-lm's TokenizerWrapper and our commands use
    of a Hugging Face tokenizer (encode, decode, special token ids, vocabulary); it has no chat
    template (pass --tokenizer for one)."""

    chat_template = None

    def __init__(self, meta):
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as pb

        tokens = list(meta["tokenizer.ggml.tokens"])
        scores = meta.get("tokenizer.ggml.scores")
        types = meta.get("tokenizer.ggml.token_type")
        scores = [0.0] * len(tokens) if scores is None else [float(s) for s in scores]
        types = [1] * len(tokens) if types is None else [int(t) for t in types]
        ids = {key: int(_scalar(meta, f"tokenizer.ggml.{key}_token_id", -1))
               for key in ("unknown", "bos", "eos", "padding")}
        if not 0 <= ids["unknown"] < len(tokens):
            raise UserError("GGUF tokenizer metadata names no unknown token; "
                            "pass --tokenizer PATH_OR_REPO")
        proto = pb.ModelProto()
        spec = proto.trainer_spec
        spec.model_type, spec.vocab_size, spec.byte_fallback = pb.TrainerSpec.BPE, len(tokens), True
        spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = (
            ids[k] for k in ("unknown", "bos", "eos", "padding"))
        norm = proto.normalizer_spec
        norm.name, norm.escape_whitespaces, norm.remove_extra_whitespaces = "identity", True, False
        self.add_dummy_prefix = bool(_scalar(meta, "tokenizer.ggml.add_space_prefix", True))
        norm.add_dummy_prefix = self.add_dummy_prefix
        for i, (piece, score, kind) in enumerate(zip(tokens, scores, types)):
            # GGUF token types number as sentencepiece's (1 normal .. 6 byte); one unknown piece
            proto.pieces.add(piece=piece, score=score,
                             type=2 if i == ids["unknown"] else (kind if kind != 2 else 1))
        self.sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        self._tokens = tokens
        self._vocab = {t: i for i, t in enumerate(tokens)}
        self.add_bos = bool(_scalar(meta, "tokenizer.ggml.add_bos_token", True))
        self.add_eos = bool(_scalar(meta, "tokenizer.ggml.add_eos_token", False))
        self.bos_token_id, self.eos_token_id = (ids[k] if ids[k] >= 0 else None
                                                for k in ("bos", "eos"))
        self.bos_token, self.eos_token = (None if i is None else tokens[i]
                                          for i in (self.bos_token_id, self.eos_token_id))
        self.pad_token_id = ids["padding"] if ids["padding"] >= 0 else None
        self.unk_token_id = ids["unknown"]
        self.all_special_ids = sorted(i for i, t in enumerate(types) if t == 3)

    def __len__(self):
        return len(self._tokens)

    def encode(self, text, add_special_tokens=True):
        ids = self.sp.encode(text)
        if add_special_tokens:
            ids = ([self.bos_token_id] if self.add_bos and self.bos_token_id is not None
                   else []) + ids
            ids += [self.eos_token_id] if self.add_eos and self.eos_token_id is not None else []
        return ids

    def decode(self, ids, skip_special_tokens=False):
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            special = set(self.all_special_ids)
            ids = [i for i in ids if i not in special]
        return self.sp.decode(ids)

    def get_vocab(self):
        return dict(self._vocab)

    @property
    def vocab(self):
        return self._vocab

    def convert_ids_to_tokens(self, ids):
        return ([self._tokens[i] for i in ids] if isinstance(ids, (list, tuple))
                else self._tokens[ids])

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self._vocab.get(tokens, self.unk_token_id)
        return [self._vocab.get(t, self.unk_token_id) for t in tokens]

