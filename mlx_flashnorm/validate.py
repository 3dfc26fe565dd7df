"""Validation of Hugging Face checkpoints and of the weights of every format, at the boundary.

One place for each thing read: every file opened as a model's, a tokenizer's or a cache's (only
a regular file is opened, and never waiting: open_file, read_json); safetensors files (the header:
dtypes, shapes, byte ranges inside the file that overlap no other) and their index.json (valid
JSON whose weight_map names files inside the model folder); config.json (the type and range of
every key the loader reads, from the model's ModelArgs annotations); the weights handed to a model
whatever their format (each role's dtype, a quantization block that matches them, finite values);
the tokenizer (no id past the embedding); the chat template (it compiles and renders).
Every failure is a UserError naming the file and the field, so nothing damaged loads silently.
(GGUF files: validate_gguf.)"""
import dataclasses
import errno
import fnmatch
import json
import math
import operator
import os
import stat
import typing
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .errors import UserError

MAX_CONTEXT = 1 << 24  # 16M positions: far beyond any published model, far below an overflow
CONTEXT_KEYS = ("max_position_embeddings", "max_context_length", "rope_max_length")
# blocks: published models have at most ~130; a damaged count would build for hours
MAX_LAYERS = 1024
LAYER_KEYS = ("num_hidden_layers", "num_transformer_layers")
MAX_HEADER = 100 << 20  # bytes: a safetensors header larger than this is damage, not a model
SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
                      "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
                      "F64": 8}
FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _show(v):
    text = json.dumps(v) if isinstance(v, (dict, list, str, bool, type(None))) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


# files -------------------------------------------------------------------------------------------

SPECIAL = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFDIR: "a folder",
           stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
           stat.S_IFBLK: "a block device"}


def file_error(path, e):
    """The one-line UserError for an OSError met opening or reading path."""
    if e.errno == errno.ELOOP:
        why = "a loop of symbolic links that never reaches a file"
    elif e.errno in (errno.EACCES, errno.EPERM):
        why = "permission denied; check its permissions"
    elif e.errno == errno.EISDIR:
        why = "a folder, not a file"
    else:
        why = e.strerror or type(e).__name__
    return UserError(f"{path}: cannot be read ({why})")


@contextmanager
def open_file(path):
    """path opened for reading (binary), only if it is a regular file: it is opened without
    waiting (opening a FIFO for reading waits for a writer forever) and checked before a byte is
    read. A FIFO, a folder, a device, a symbolic link loop, an unreadable or a missing file is a
    one-line UserError naming it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise file_error(path, e) from None
    try:
        kind = stat.S_IFMT(os.fstat(fd).st_mode)
        if kind != stat.S_IFREG:
            raise UserError(f"{path}: is {SPECIAL.get(kind, 'a special file')}, not a regular "
                            "file; remove it or put the real file there")
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        try:
            yield f
        except OSError as e:  # a read that fails (an I/O error, a file cut short under us)
            raise file_error(path, e) from None


def check_file(path):
    """path is a regular file this process can read (open_file), for a reader that opens it
    itself (MLX's loaders, the tokenizer libraries). Returns path."""
    with open_file(path):
        return path


def present(path):
    """Whether something is at path (a broken link, a loop or an unreadable file too: opening it
    then says what is wrong), never raising."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    return True


def read_folder(folder):
    """The names in a folder; an unreadable one is a one-line UserError naming it."""
    try:
        return os.listdir(folder)
    except OSError as e:
        raise file_error(folder, e) from None


def folder_files(folder, patterns):
    """The names in folder (read_folder) that match one of the glob patterns, each checked to be
    a regular file this process can read (check_file)."""
    names = {n for n in read_folder(folder) if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
    for name in sorted(names):
        check_file(Path(folder) / name)
    return names


def read_json(path, what="valid JSON", fix="the file is damaged"):
    """The JSON document in the regular file path (open_file); invalid JSON, UTF-8 or nesting too
    deep for the parser is a one-line UserError naming the file: "PATH: not WHAT (...); FIX"."""
    with open_file(path) as f:
        raw = f.read()
    try:
        return json.loads(raw)
    except RecursionError:
        detail = "nested too deeply to read"
    except (ValueError, UnicodeDecodeError) as e:
        detail = str(e).splitlines()[0]
    raise UserError(f"{path}: not {what} ({detail}); {fix}")


# safetensors -------------------------------------------------------------------------------------

def safetensors_files(folder):
    """The weight files of a checkpoint folder: the shards its index.json names (each inside the
    folder), else every *.safetensors in it."""
    index = folder / "model.safetensors.index.json"
    if not present(index):
        return sorted(folder / n for n in read_folder(folder) if n.endswith(".safetensors"))
    weight_map = read_json(index, "a valid index", "the file is damaged, download it again")
    if not isinstance(weight_map, dict):
        raise UserError(f"{index}: not a valid index (not a JSON object); the file is damaged, "
                        "download it again")
    weight_map = weight_map.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise UserError(f"{index}: 'weight_map' is missing or not an object of tensor name -> file "
                        "name; the file is damaged, download it again")
    root = folder.resolve()
    shards = sorted(set(weight_map.values()))
    for s in shards:
        target = (folder / s).resolve()
        if Path(s).is_absolute() or target.parent != root or not s.endswith(".safetensors"):
            raise UserError(f"{index}: 'weight_map' names '{s}', which is not a .safetensors file "
                            "in the model folder; the index is damaged or hostile, download it "
                            "again")
        if not present(folder / s):
            raise UserError(f"{folder}: shard {s} listed in {index.name} is missing; "
                            "download it again")
    return [folder / s for s in shards]


def safetensors_header(file):
    """Check a safetensors file's header (its length, JSON, each tensor's dtype, shape and byte
    range inside the data, no two ranges overlapping); returns the tensor names."""
    def bad(why):
        return UserError(f"{file}: {why}; the file is truncated or corrupt, download it again")

    with open_file(file) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(size - 8, MAX_HEADER):
            raise bad(f"header length {n} does not fit the file's {size} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except RecursionError:
        raise bad("header is JSON nested too deeply to read")
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"header is not valid JSON ({str(e).splitlines()[0]})")
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    data, spans = size - 8 - n, []
    for name, info in header.items():
        if name == "__metadata__":
            if info is not None and not (isinstance(info, dict)
                                         and all(isinstance(v, str) for v in info.values())):
                raise bad(f"'__metadata__' is {_show(info)}, not an object of strings")
            continue
        spans.append(_tensor_span(name, info, data, bad))
    spans.sort()
    for (start, end, name), (nxt, _, other) in zip(spans, spans[1:]):
        if nxt < end:
            raise bad(f"tensors '{name}' and '{other}' share bytes {nxt}-{end}")
    return [name for _, _, name in spans]


def _tensor_span(name, info, data, bad):
    if not isinstance(info, dict):
        raise bad(f"header entry '{name}' is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPES:
        raise bad(f"tensor '{name}' has unknown dtype {_show(dtype)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"tensor '{name}' has shape {_show(shape)}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data):
        raise bad(f"tensor '{name}' has data_offsets {_show(offsets)}, not a range inside the "
                  f"{data} bytes of data")
    if offsets[1] - offsets[0] != math.prod(shape) * SAFETENSORS_DTYPES[dtype]:
        raise bad(f"tensor '{name}' ({dtype}, shape {shape}) needs "
                  f"{math.prod(shape) * SAFETENSORS_DTYPES[dtype]} bytes, its range holds "
                  f"{offsets[1] - offsets[0]}")
    return offsets[0], offsets[1], name


# config.json -------------------------------------------------------------------------------------

def config_object(config, file):
    """config.json holds an object with a model_type string."""
    if not isinstance(config, dict):
        raise UserError(f"{file}: must hold a JSON object of settings, not {_show(config)}; "
                        "the file is damaged")
    if "model_type" not in config:
        raise UserError(f"{file}: missing required key 'model_type'")
    if not isinstance(config["model_type"], str):
        raise UserError(f"{file}: 'model_type' must be a string, not {_show(config['model_type'])}")


def config_values(config, model_args_class, source):
    """Every key of config that the model reads (the fields of its ModelArgs dataclass) has its
    annotated type, and every number in it is finite and positive (sizes, counts, RoPE bases,
    epsilons, scales: none of them may be 0 or negative); contexts are at most MAX_CONTEXT; token
    ids lie in the vocabulary; rope_scaling is an object of positive numbers and names."""
    hints = typing.get_type_hints(model_args_class)
    for f in dataclasses.fields(model_args_class):
        if f.name not in config:
            continue
        value, kind = config[f.name], hints[f.name]
        if not _matches(value, kind):
            raise UserError(f"{source}: '{f.name}' must be {_describe(kind)}, not {_show(value)}")
        for x in _numbers(value):
            if not math.isfinite(x) or x <= 0:
                raise UserError(f"{source}: '{f.name}' must be positive, not {_show(value)}")
            if _is_int(x) and x > MAX_CONTEXT:
                raise UserError(f"{source}: '{f.name}' is {x}, beyond any model's "
                                f"(at most {MAX_CONTEXT}); the file is damaged")
    for key in CONTEXT_KEYS:
        if _is_number(config.get(key)) and config[key] > MAX_CONTEXT:
            raise UserError(f"{source}: '{key}' is {config[key]}, beyond any model's context "
                            f"(at most {MAX_CONTEXT}); the file is damaged")
    for key in LAYER_KEYS:
        if _is_number(config.get(key)) and config[key] > MAX_LAYERS:
            raise UserError(f"{source}: '{key}' is {config[key]}, beyond any model's (at most "
                            f"{MAX_LAYERS}); the file is damaged")
    if not isinstance(config.get("rope_parameters", {}), (dict, type(None))):
        raise UserError(f"{source}: 'rope_parameters' must be an object or null, "
                        f"not {_show(config['rope_parameters'])}")
    _rope_scaling(config.get("rope_scaling"), source)
    _token_ids(config, source)


def _rope_scaling(scaling, source):
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise UserError(f"{source}: 'rope_scaling' must be an object such as "
                        f"{{\"rope_type\": \"linear\", \"factor\": 2.0}} or null, "
                        f"not {_show(scaling)}")
    for key, v in scaling.items():
        if _is_number(v) and (not math.isfinite(v) or v <= 0):
            raise UserError(f"{source}: 'rope_scaling' '{key}' must be positive, not {_show(v)}")
        if v is not None and not _is_number(v) and not isinstance(v, str):
            raise UserError(f"{source}: 'rope_scaling' '{key}' must be a number or a name, "
                            f"not {_show(v)}")


def _token_ids(config, source):
    vocab = config.get("vocab_size")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = config.get(key)
        ids = v if isinstance(v, list) else [v]
        if v is None:
            continue
        if not all(_is_int(i) for i in ids):
            raise UserError(f"{source}: '{key}' must be a token id or a list of them, "
                            f"not {_show(v)}")
        if _is_int(vocab) and any(i >= vocab for i in ids):
            raise UserError(f"{source}: '{key}' {_show(v)} lies outside the vocabulary of "
                            f"{vocab} tokens")


def _matches(value, kind):
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is typing.Any:
        return True
    if origin is typing.Union:
        return any(_matches(value, a) for a in args)
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return _is_int(value)
    if kind is float:
        return _is_number(value)
    if kind is str:
        return isinstance(value, str)
    if kind is dict or origin is dict:
        return isinstance(value, dict)
    if kind is list or origin is list:
        return (isinstance(value, list) and all(_matches(v, args[0]) for v in value) if args
                else isinstance(value, list))
    return True  # a type this check does not know: the model's own code decides


def _describe(kind):
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Union:
        return " or ".join(_describe(a) for a in args)
    if origin is list:
        return f"a list of ({_describe(args[0])})" if args else "a list"
    if kind is dict or origin is dict:
        return "an object"
    return {int: "a whole number", float: "a number", bool: "true or false", str: "a string",
            type(None): "null"}.get(kind, str(kind))


def _numbers(value):
    if _is_number(value):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)


# weights -----------------------------------------------------------------------------------------

def _quantized(weights):
    return {k[: -len(".scales")] for k in weights if k.endswith(".scales")}


def weights(weights, source):
    """The weights a model is about to receive, whatever their format: float weights in a float
    dtype (an integer dtype would be used as numbers, silently), quantized ones packed in uint32
    with float scales and biases."""
    quantized = _quantized(weights)
    for name, w in weights.items():
        stem = name.rsplit(".", 1)[0]
        if stem in quantized and name.endswith(".weight"):
            ok, want = w.dtype == mx.uint32, "uint32 (packed quantized values)"
        else:
            ok, want = w.dtype in FLOAT_DTYPES, "float16, bfloat16 or float32"
        if not ok:
            raise UserError(f"{source}: tensor '{name}' has dtype "
                            f"{str(w.dtype).split('.')[-1]}, but its role needs {want}; "
                            "the checkpoint is damaged")


def quantization(config, weights, source):
    """config's quantization block (mlx-lm's: group_size, bits, per-module overrides) describes
    the quantized weights: each one's packed width and scales agree with its bits and group size."""
    q, quantized = config.get("quantization"), _quantized(weights)
    if q is None:
        return  # scales without a quantization block: load_weights names them as unexpected
    where = f"{source}: the 'quantization' block"
    if not isinstance(q, dict) or not _is_int(q.get("group_size")) or not _is_int(q.get("bits")) \
            or q["group_size"] <= 0 or q["bits"] <= 0:
        raise UserError(f"{where} needs whole numbers 'group_size' and 'bits', not {_show(q)}")
    if not quantized:
        raise UserError(f"{where} says the weights are quantized, but no weight is "
                        "(no .scales tensors)")
    for mod in sorted(quantized):
        spec = q.get(mod) if isinstance(q.get(mod), dict) else q
        gs, bits = spec.get("group_size"), spec.get("bits")
        w, s, b = (weights.get(f"{mod}.{k}") for k in ("weight", "scales", "biases"))
        if w is None or (b is not None and b.shape != s.shape) or not _is_int(gs) \
                or not _is_int(bits) or w.shape[:-1] != s.shape[:-1] \
                or w.shape[-1] * 32 != s.shape[-1] * gs * bits or q.get(mod) is False:
            raise UserError(f"{where} ({bits}-bit, group size {gs}) does not match the weights of "
                            f"'{mod}'; the config or the weights are damaged")


# the bits whose all being set make NaN or infinity
EXPONENT = {mx.float16: (mx.uint16, 0x7C00), mx.bfloat16: (mx.uint16, 0x7F80),
            mx.float32: (mx.uint32, 0x7F800000)}


def finite(model, source):
    """Refuse non-finite weights (NaN or infinity), naming the first such tensor: one integer max
    a tensor over its exponent bits (on the CPU faster than isfinite().all(), which computes
    float16 in emulation; its cost: bench/RESULTS.md, "Loading checks"), over parameters already
    in memory after loading."""
    params = [(k, v) for k, v in tree_flatten(model.parameters()) if v.dtype in EXPONENT]
    if not params:
        return
    bad = mx.stack([(v.view(EXPONENT[v.dtype][0]) & EXPONENT[v.dtype][1]).max()
                    == EXPONENT[v.dtype][1] for _, v in params])
    if not bad.any().item():
        return
    name = params[bad.tolist().index(True)][0]
    raise UserError(f"{source}: tensor '{name}' holds NaN or infinite values; "
                    "the weights are damaged")


# tokenizer ---------------------------------------------------------------------------------------

def tokenizer_ids(tokenizer, vocab_size, source):
    """Every id the tokenizer can produce (its vocabulary, added and special tokens) lies below
    vocab_size, the embedding's rows (config and weights agree on them: the model's load is
    strict about shapes): an id past them would read beyond the embedding. A tokenizer smaller
    than the embedding is normal (padding rows). One max over the ids, no loop in Python."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds it
    backend = getattr(hf, "backend_tokenizer", None)  # a fast tokenizer: tokenizer.json
    vocab = backend.get_vocab(with_added_tokens=True) if backend is not None else hf.get_vocab()
    token, top = max(vocab.items(), key=operator.itemgetter(1), default=(None, -1))
    added = getattr(hf, "added_tokens_decoder", None) or {}
    for i in [*added, *(getattr(hf, "all_special_ids", None) or [])]:
        if _is_int(i) and i > top:
            token, top = str(added.get(i, i)), i
    if top >= vocab_size:
        raise UserError(f"{source}: token {token!r} has id {top}, beyond the model's vocabulary "
                        f"of {vocab_size} (its embedding's rows); the tokenizer is damaged or not "
                        "this model's: pass --tokenizer with the model's own")


# chat template -----------------------------------------------------------------------------------

def chat_template(tokenizer, source):
    """A chat template compiles and renders a one-message conversation; a broken one (a Jinja
    syntax error, an unknown filter) is refused at load instead of at the first request."""
    if not getattr(tokenizer, "has_chat_template", False):
        return
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                      add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja2's TemplateError subclasses, and whatever the template raises
        line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{source}: the chat template is broken{line}: {detail}; fix it, or pass "
                        "--tokenizer with a working one")
