"""Run under `mlx.launch -n N` by tests/test_distributed.py: for each checkpoint folder and norm mode,
load() the model sharded over the N processes (shard.py) and whole in this process, and write to
OUT/rank{r}.json what the test compares: the logits of a prompt, the greedy tokens of the compiled
decode loop, and the bytes of the weights each form holds; and the logits of the whole model
split after loading (shard.shard).

usage: distributed_check.py OUT PROMPT_LENGTH NEW_TOKENS NORMS FOLDER... (FOLDER "embedded": the
embedded SmolLM2); the activation dtype is $DTYPE (default: auto, float32 on the CPU)."""
import json
import os
import re
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_flashnorm.generate import generate_step
from mlx_flashnorm.loader import load
from mlx_flashnorm.shard import shard, world


# the split linears, and the embedding and LM head (split by vocabulary rows)
SPLIT = re.compile(r"(q|k|v|qkv|o|out|gate|up|gate_up|down)_proj\.|proj_[12]\.|embed_tokens\.|token_embeddings\.|lm_head\.")


def split_bytes(model):
    """The bytes of the split arrays (the bias of a row-parallel linear stays whole)."""
    return sum(v.nbytes for k, v in tree_flatten(model.parameters()) if SPLIT.search(k) and not k.endswith(".bias"))


def run(model, prompt, new_tokens):
    logits = model(prompt[None])[0].astype(mx.float32)
    tokens = [t for t, _ in generate_step(prompt, model, max_tokens=new_tokens)] if new_tokens else []
    return logits, tokens


def main():
    out, length, new_tokens, norms, folders = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4].split(","), sys.argv[5:]
    group = world()
    results = {"size": group.size()}
    for folder in folders:
        for norm in norms:
            path = None if folder == "embedded" else folder
            dtype = os.environ.get("DTYPE", "auto")
            sharded, _ = load(path, norm=norm, dtype=dtype, progress=False)
            whole, _ = load(path, norm=norm, dtype=dtype, progress=False, distributed=False)
            prompt = mx.arange(3, 3 + length) * 7 % whole.args.vocab_size
            logits, tokens = run(sharded, prompt, new_tokens)
            ref_logits, ref_tokens = run(whole, prompt, new_tokens)
            late_logits = ref_logits  # the embedded model: not loaded a third time
            if path is not None:  # split once loaded
                late_logits = shard(load(path, norm=norm, dtype=dtype, progress=False,
                                         distributed=False)[0])(prompt[None])[0].astype(mx.float32)
            results[f"{Path(folder).name}/{norm}"] = {
                "rel": (mx.abs(logits - ref_logits).max() / mx.abs(ref_logits).max()).item(),
                "late_rel": (mx.abs(late_logits - ref_logits).max() / mx.abs(ref_logits).max()).item(),
                "tokens": tokens, "ref_tokens": ref_tokens,
                "checksum": mx.sum(logits * mx.arange(logits.size).reshape(logits.shape) % 97).item(),
                "split_bytes": split_bytes(sharded), "ref_split_bytes": split_bytes(whole),
                "bytes": sum(v.nbytes for _, v in tree_flatten(sharded.parameters())),
                "ref_bytes": sum(v.nbytes for _, v in tree_flatten(whole.parameters())),
                "n_heads": [m.n_heads for _, m in sharded.named_modules() if hasattr(m, "n_heads")],
                "ref_n_heads": [m.n_heads for _, m in whole.named_modules() if hasattr(m, "n_heads")],
            }
    Path(out, f"rank{group.rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
