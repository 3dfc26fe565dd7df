"""A multi-turn chat in the terminal: `python -m mlx_flashnorm.chat`.

The KV cache is kept across turns: each turn prefills only the tokens that the chat template adds
after those the cache already holds (the reply just generated, the closing tags, the new
message)."""
import argparse
import sys
from contextlib import closing

import mlx.core as mx

from .cache import make_cache
from .cli import HelpFormatter, add_generation_args, add_model_args, add_sampling_args
from .errors import UserError, run_cli
from .decoding import (cache_capacity, context_length, eager_cache, encode_chat, load_from_args,
                       stream_generate)
from .generate import generation_kwargs
from .lockstep import lockstep, shared


class Chat:
    def __init__(self, model, tokenizer, system_prompt=None, max_tokens=256, max_kv_size=None,
                 kv_bits=None, kv_group_size=64, **sampling):
        """sampling: stream_generate's sampling arguments. max_kv_size, kv_bits: keep the
        conversation in mlx-lm's rotating or quantized cache (eager_cache), decoded eagerly."""
        if not tokenizer.has_chat_template:
            raise UserError("this model's tokenizer has no chat template: pass one with "
                            "--chat-template FILE_OR_TEXT, or use the generate command")
        self.model, self.tokenizer, self.system_prompt = model, tokenizer, system_prompt
        self.max_tokens, self.sampling = max_tokens, sampling
        self.eager = (max_kv_size, kv_bits, kv_group_size) if max_kv_size or kv_bits else None
        if self.eager:
            eager_cache(model, *self.eager)  # checks the settings now
        self.reset()

    def reset(self):
        self.messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt
                         else [])
        self.cache, self.cached = None, []  # cached: the token ids the cache holds, in order

    def reply(self, text):
        """Yield the answer to the user's message `text` piece by piece; it then joins the
        conversation."""
        messages = self.messages + [{"role": "user", "content": text}]
        tokens = encode_chat(self.tokenizer, messages)
        ctx = context_length(self.model)
        if len(tokens) >= ctx:
            raise UserError(f"the conversation would have {len(tokens)} tokens, the model's "
                            f"context is {ctx}: /reset starts a new one")
        keep = 0  # the cached tokens that the conversation still begins with stay in the cache
        while keep < min(len(self.cached), len(tokens) - 1) and self.cached[keep] == tokens[keep]:
            keep += 1
        keep = self._make_room(keep, min(ctx, len(tokens) + self.max_tokens))
        self.cached = tokens[:keep]
        answer, generated = "", []
        for r in lockstep(stream_generate(self.model, self.tokenizer, tokens[keep:],
                                          self.max_tokens, cache=self.cache, **self.sampling)):
            answer += r.text
            generated.append(r.token)
            yield r.text
        self.cached = (tokens + generated)[:self.cache[0].offset]
        self.messages = messages + [{"role": "assistant", "content": answer}]

    def _make_room(self, keep, needed):
        """Trim the cache to its first `keep` positions, with room for `needed` in all (an eager
        cache grows; a rotating one that has wrapped around starts again)."""
        if self.eager:
            if self.cache is None or not all(c.is_trimmable() for c in self.cache):
                self.cache, self.cached = eager_cache(self.model, *self.eager), []
                return 0
            for c in self.cache:
                c.trim(c.offset - keep)
            return keep
        if self.cache is None or self.cache[0].capacity < needed:
            old, self.cache = self.cache, make_cache(self.model, cache_capacity(self.model, needed))
            if old and keep:
                for c, o in zip(self.cache, old):
                    c.update_and_fetch(o.keys[..., :keep, :], o.values[..., :keep, :])
        for c in self.cache:
            c.offset = keep
        return keep


def arg_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_flashnorm.chat",
        description="Chat with an MLX model in the terminal (or over standard input, one message "
                    "a line). /reset starts a new conversation, /exit (or end of input) quits; "
                    "Ctrl-C stops an answer (the message and the partial answer are dropped).",
        formatter_class=HelpFormatter)
    p.add_argument("--system-prompt", help="the system message that opens the conversation")
    add_model_args(p)
    add_sampling_args(p)
    add_generation_args(p)
    return p


def answer(chat, line):
    """Print the answer to one message. Ctrl-C stops it: the message and the partial answer are
    dropped (the conversation stays as it was) and the chat goes on."""
    try:
        with closing(chat.reply(line)) as pieces:
            for piece in pieces:
                print(piece, end="", flush=True)
        print(flush=True)
    except KeyboardInterrupt:
        print("\n[stopped]", flush=True)
    except UserError as e:  # too long: the message is dropped, the chat goes on
        print(f"error: {e}", file=sys.stderr, flush=True)


def main(argv=None):
    args = arg_parser().parse_args(argv)
    kwargs = generation_kwargs(args)  # checks the flags before loading
    model, tokenizer = load_from_args(args)
    chat = Chat(model, tokenizer, args.system_prompt, max_tokens=args.max_tokens, **kwargs)
    if args.seed is not None:
        mx.random.seed(args.seed)
    interactive = sys.stdin.isatty()
    if interactive:
        print("Chat: /reset starts a new conversation, /exit or Ctrl-D quits, Ctrl-C stops an "
              "answer.")
    try:
        while True:
            try:
                line = shared(lambda: input(">> " if interactive else "").strip())  # rank 0's
            except EOFError:
                break
            if line == "/exit":
                break
            if line == "/reset":
                chat.reset()
                print("[new conversation]", flush=True)
            elif line:
                answer(chat, line)
    except KeyboardInterrupt:
        print()


if __name__ == "__main__":
    run_cli(main)
