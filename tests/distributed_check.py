"""Run under `mlx.launch -n N` by tests/test_distributed.py: for each checkpoint folder and norm mode,
load() the model sharded over the N processes (shard.py) and whole in this process, and write to
OUT/rank{r}.json what the test compares: the logits of a prompt, the greedy tokens of the compiled
decode loop, and the bytes of the weights each form holds; and the logits of the whole model
split after loading (shard.shard).

usage: distributed_check.py OUT PROMPT_LENGTH NEW_TOKENS NORMS FOLDER... [-- SERVER_ARGS...]
(FOLDER "embedded": the embedded SmolLM2); the activation dtypes are $DTYPE, comma-separated
(default: auto, float32 on the CPU; with several, each result's key ends in /DTYPE). With
$REF_ON_RANK0 set only rank 0 loads the whole model (the reference is the same on every rank): the
other ranks' results lack the ref_ keys, and every rank writes its prompt's logits to
OUT/rank{r}-{folder}-{norm}.npy (rank 0 also the reference's, OUT/ref-{folder}-{norm}.npy) for the
test to compare. With `-- SERVER_ARGS` the same processes then run
`python -m mlx_flashnorm.server SERVER_ARGS`, their results written (the ranks started once for
both)."""
import json
import os
import re
import runpy
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_flashnorm.decoding import generate_step
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


def main(argv):
    out, length, new_tokens, norms, folders = argv[0], int(argv[1]), int(argv[2]), \
        argv[3].split(","), argv[4:]
    group = world()
    results = {"size": group.size()}
    dtypes = os.environ.get("DTYPE", "auto").split(",")
    ref_here = "REF_ON_RANK0" not in os.environ or group.rank() == 0
    for dtype in dtypes:
        for folder in folders:
            for norm in norms:
                path = None if folder == "embedded" else folder
                sharded, _ = load(path, norm=norm, dtype=dtype, progress=False)
                prompt = mx.arange(3, 3 + length) * 7 % sharded.args.vocab_size
                logits, tokens = run(sharded, prompt, new_tokens)
                key = f"{Path(folder).name}/{norm}" + (f"/{dtype}" if len(dtypes) > 1 else "")
                result = results[key] = {
                    "tokens": tokens,
                    "checksum": mx.sum(logits * mx.arange(logits.size).reshape(logits.shape) % 97).item(),
                    "split_bytes": split_bytes(sharded),
                    "bytes": sum(v.nbytes for _, v in tree_flatten(sharded.parameters())),
                    "n_heads": [m.n_heads for _, m in sharded.named_modules() if hasattr(m, "n_heads")],
                }
                if "REF_ON_RANK0" in os.environ:
                    np.save(Path(out, f"rank{group.rank()}-{key.replace('/', '-')}.npy"), np.array(logits))
                if not ref_here:
                    continue
                whole, _ = load(path, norm=norm, dtype=dtype, progress=False, distributed=False)
                ref_logits, ref_tokens = run(whole, prompt, new_tokens)
                result.update({
                    "rel": (mx.abs(logits - ref_logits).max() / mx.abs(ref_logits).max()).item(),
                    "ref_tokens": ref_tokens, "ref_split_bytes": split_bytes(whole),
                    "ref_bytes": sum(v.nbytes for _, v in tree_flatten(whole.parameters())),
                    "ref_n_heads": [m.n_heads for _, m in whole.named_modules() if hasattr(m, "n_heads")],
                })
                if "REF_ON_RANK0" in os.environ:
                    np.save(Path(out, f"ref-{key.replace('/', '-')}.npy"), np.array(ref_logits))
                late_logits = ref_logits  # the embedded model: not split a second time
                if path is not None:  # split once loaded: the whole model, its reference taken
                    late_logits = shard(whole)(prompt[None])[0].astype(mx.float32)
                result["late_rel"] = (mx.abs(late_logits - ref_logits).max() / mx.abs(ref_logits).max()).item()
    Path(out, f"rank{group.rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    args = sys.argv[1:]
    serve = args[args.index("--") + 1:] if "--" in args else None
    main(args[:args.index("--")] if serve is not None else args)
    if serve is not None:  # (mx.distributed.init() again gives the group the check used)
        # the other ranks wait for rank 0's reference, which only it computes, asleep: in the
        # server's first collective they would spin, taking the cores from rank 0
        waited = time.monotonic() + 300
        while not Path(args[0], "rank0.json").is_file():
            if time.monotonic() > waited:
                sys.exit("error: rank 0 wrote no results in 300 s")
            time.sleep(0.05)
        sys.argv = ["mlx_flashnorm.server", *serve]
        runpy.run_module("mlx_flashnorm.server", run_name="__main__", alter_sys=True)
