"""--chat-template: a Jinja chat template given on the command line (a file or the text itself),
rendered as Hugging Face's apply_chat_template renders one (a sandboxed Jinja environment with
trim_blocks and lstrip_blocks, raise_exception and the tokenizer's special tokens), for any of our
tokenizers, a GGUF's included."""
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import UserError


def read_template(value):
    """The template text: the file `value` names, else `value` itself (it must look like Jinja)."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: cannot read the chat template ({type(e).__name__}: {e})")
    if "{{" not in value and "{%" not in value:
        raise UserError(f"--chat-template {value!r}: no such file, and not a Jinja template "
                        "(no {{ or {%); pass a template file or the template text")
    return value


def compile_template(text):
    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(text)
    except TemplateError as e:
        raise UserError(f"the chat template is not valid Jinja ({e})")


def set_chat_template(tokenizer, value):
    """Make the wrapped tokenizer (mlx-lm's TokenizerWrapper) render chats with the template that
    value gives (read_template); the wrapper then encodes the text without adding special tokens,
    as it does for a template of its own."""
    template = compile_template(read_template(value))
    specials = {k: getattr(tokenizer, k, None) or ""
                for k in ("bos_token", "eos_token", "unk_token", "pad_token")}

    def render(messages, add_generation_prompt=False, **kwargs):
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **specials, **kwargs)
        except TemplateError as e:
            raise UserError(f"the chat template failed to render: {e}")

    tokenizer._chat_template = render
    tokenizer.has_chat_template = True
    return tokenizer
