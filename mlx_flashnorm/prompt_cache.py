"""--prompt-cache-file: a prefilled prompt's KV cache on disk, reused by a later run whose prompt
begins with the same tokens (only the rest is prefilled).

The file is mlx-lm's prompt-cache format (mlx_lm.models.cache.save_prompt_cache: safetensors, the
cache classes in its metadata) with three entries of ours in that metadata: the model it was made
with, the prompt's token ids and the KV bits. It is written to a temporary file beside it and
renamed into place, so a run cut short leaves the old file or none."""
import json
import os
from pathlib import Path

from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from .errors import UserError

SUFFIX = ".safetensors"


def check_path(path):
    path = Path(path)
    if path.suffix != SUFFIX:
        raise UserError(f"{path}: a prompt cache file's name must end in {SUFFIX}")
    if not path.parent.is_dir():
        raise UserError(f"{path.parent}: no such folder for the prompt cache file")
    return path


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def reuse(path, model, model_id, tokens, kv_bits=None):
    """(cache, kept): the cache in the file trimmed to the longest prefix its prompt shares with
    `tokens` (never all of them: the last prompt token must be fed to get logits), and that
    prefix's length; (None, 0) when there is no file yet."""
    path = check_path(path)
    if not path.exists():
        return None, 0
    try:
        cache, meta = load_prompt_cache(str(path), return_metadata=True)
        cached = json.loads(meta["tokens"])
        saved_for, saved_bits = meta["model"], meta["kv_bits"]
    except Exception as e:
        raise UserError(f"{path}: not a prompt cache file of ours ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else 'no detail'}); delete it or pass another")
    if saved_for != model_id or len(cache) != len(model.layers):
        raise UserError(f"{path} holds the prompt cache of model {saved_for}, not of {model_id}: "
                        "pass another --prompt-cache-file or delete this one")
    if saved_bits != str(kv_bits):
        raise UserError(f"{path} was saved with --kv-bits {saved_bits}, this run has {kv_bits}: "
                        "pass the same --kv-bits or another file")
    kept = common_prefix(cached, tokens[:-1])
    if not all(c.is_trimmable() for c in cache):
        if kept < len(cached):
            raise UserError(f"{path}: its rotating cache cannot be cut back to the {kept} prompt tokens "
                            "this prompt shares with it; delete it or pass another file")
    for c in cache:
        c.trim(c.offset - kept)
    return cache, kept


def save(path, cache, model_id, tokens, kv_bits=None):
    """Write the cache, cut back to the prompt `tokens` (a generation leaves its own tokens in it),
    atomically. Returns False (nothing written) when the cache cannot be cut back (a rotating cache
    that has wrapped around)."""
    path = check_path(path)
    extra = cache[0].offset - len(tokens)
    if extra > 0 and not all(c.is_trimmable() for c in cache):
        return False
    for c in cache:
        c.trim(extra)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{SUFFIX}")
    try:
        save_prompt_cache(str(tmp), cache, {"model": model_id, "tokens": json.dumps(list(tokens)),
                                            "kv_bits": str(kv_bits)})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return True
