"""What a grammar's token mask costs the host per token (constrained decoding, constraints.py).

    python -m mlx_flashnorm.bench.mask_cost [--model X] [--reps 5]

For each grammar (any JSON object, a JSON schema with enums, arrays and nesting, a forced tool
call) a fixed text it accepts is tokenized and replayed --reps times through a fresh
constraints.Constraint: per token, llguidance's mask alone (its bitmask computed), the whole of
Constraint.allowed() (the bitmask unpacked into an MLX boolean array) and accept(token), and the
masks of 32 rows under the grammar at once (constraints.allowed_rows, as a served step takes them).
Prints the median and 90th percentile of each in microseconds (and the mask's slowest), and the
one-time cost of llguidance's tokenizer and of a grammar's matcher. The mask is computed while
the device runs the step (serve/runner.py), so it costs a step nothing where it takes less than
the step."""
import argparse
import json
import statistics
import time

import mlx.core as mx

from .. import constraints
from ..errors import HelpFormatter, run_cli
from ..loader import default_model_path, load
from ..serve.tools import Tools

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "color", "tags", "home"],
          "properties": {"name": {"type": "string"}, "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "home": {"type": "object", "required": ["city"],
                                  "properties": {"city": {"type": "string"}}}}}
PERSON = {"name": "Ada Lovelace", "color": "green", "tags": ["math", "engines", "poetry"],
          "home": {"city": "London"}}
TOOL = Tools([{"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}], "required", "hermes", False)
CASES = [("json_object", constraints.JSON_OBJECT, json.dumps(PERSON, indent=2)),
         ("json_schema", constraints.schema_grammar(SCHEMA), json.dumps(PERSON, indent=2)),
         ("tool call", TOOL.grammar(),
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
          "</tool_call>")]


def percentiles(xs):
    xs = sorted(xs)
    return statistics.median(xs) * 1e6, xs[int(0.9 * (len(xs) - 1))] * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mlx_flashnorm.bench.mask_cost", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--model", help="model whose tokenizer to use (default: the embedded SmolLM2)")
    p.add_argument("--reps", type=int, default=5, help="replays of each text")
    args = p.parse_args(argv)
    model, tokenizer = load(args.model or str(default_model_path()), progress=False)
    vocab = model.args.vocab_size
    tic = time.perf_counter()
    constraints.ll_tokenizer(tokenizer, vocab)
    print(f"llguidance tokenizer: {time.perf_counter() - tic:.2f} s once, vocabulary {vocab}")
    print("| grammar | tokens | matcher (ms) | llguidance mask (us) median / p90 / max "
          "| allowed() (us) median / p90 | accept (us) median "
          "| 32 rows' allowed_rows (us) median |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, grammar, text in CASES:
        tokens = (tokenizer.encode(text, add_special_tokens=False)
                  + sorted(tokenizer.eos_token_ids)[:1])
        raw, whole, accepts, builds, batch = [], [], [], [], []
        for _ in range(max(1, args.reps)):
            tic = time.perf_counter()
            c = constraints.Constraint(grammar, tokenizer, vocab)
            builds.append(time.perf_counter() - tic)
            for t in tokens:
                tic = time.perf_counter()
                constraints.words([c])
                raw.append(time.perf_counter() - tic)
                tic = time.perf_counter()
                mx.eval(c.allowed())
                whole.append(time.perf_counter() - tic)
                assert bool(c.allowed()[t]), f"{name}: token {t} refused"
                tic = time.perf_counter()
                c.accept(t)
                accepts.append(time.perf_counter() - tic)
        rows = [constraints.Constraint(grammar, tokenizer, vocab) for _ in range(32)]
        for t in tokens:  # a batch's 32 rows under the grammar, their masks in one call
            tic = time.perf_counter()
            mx.eval(constraints.allowed_rows(rows))
            batch.append(time.perf_counter() - tic)
            for c in rows:
                c.accept(t)
        (r50, r90), (w50, w90) = percentiles(raw), percentiles(whole)
        print(f"| {name} | {len(tokens)} | {statistics.median(builds) * 1e3:.2f} | "
              f"{r50:.0f} / {r90:.0f} / {max(raw) * 1e6:.0f} | {w50:.0f} / {w90:.0f} | "
              f"{percentiles(accepts)[0]:.0f} | {percentiles(batch)[0]:.0f} |", flush=True)


if __name__ == "__main__":
    run_cli(main)
