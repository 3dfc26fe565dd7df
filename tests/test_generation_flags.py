"""The sampling and cache flags of generate and chat beside mlx_lm.generate's: --min-p, the
repetition penalty, --system-prompt, --chat-template, --kv-bits, --max-kv-size,
--prompt-cache-file and a prompt from standard input."""
import importlib
import io
import json
import math

import mlx.core as mx
import pytest
from conftest import QWEN2, cli
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache
from mlx_lm.sample_utils import make_logits_processors

from mlx_flashnorm import chat, load
from mlx_flashnorm.errors import UserError
from mlx_flashnorm.loader import model_args

gen = importlib.import_module("mlx_flashnorm.decoding")  # the module (the package attribute is the function)

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load(str(tiny_llama_dir), norm="rms", progress=False)


def tokens(model, tok, prompt="Tell me a story.", n=12, **kwargs):
    return [r.token for r in gen.stream_generate(model, tok, prompt, max_tokens=n, **kwargs)]


def test_min_p_one_keeps_only_the_likeliest_token(tiny):
    """min_p = 1 leaves only tokens as likely as the top one: temperature sampling becomes greedy
    (a random model's near-uniform distribution makes plain sampling at temp 1 differ)."""
    greedy = tokens(*tiny)
    assert tokens(*tiny, temp=1.0, seed=3) != greedy
    assert tokens(*tiny, temp=1.0, seed=3, min_p=1.0) == greedy
    with pytest.raises(UserError, match="min-p must be from 0 to 1"):
        gen.make_sampler_for(1.0, min_p=1.5)


def test_repetition_penalty_matches_mlx_lm_on_both_decode_paths(tiny):
    """Our compiled and eager decoding with mlx-lm's repetition penalty give the tokens that mlx-lm's
    own generate_step gives with it on the same model; the penalty changes them (it acts)."""
    from mlx_lm.generate import generate_step as mlx_lm_generate_step

    model, tok = tiny
    prompt = mx.array(tok.encode("the the the the the cat cat cat"))
    procs = gen.make_processors(1.8, 6)
    assert len(procs) == 1
    theirs = [t for t, _ in mlx_lm_generate_step(prompt, model, max_tokens=16,
                                                 logits_processors=make_logits_processors(repetition_penalty=1.8,
                                                                                          repetition_context_size=6))]
    for compiled in (True, False):
        ours = [t for t, _ in gen.generate_step(prompt, model, max_tokens=16, compiled=compiled,
                                                logits_processors=procs)]
        assert ours == theirs, compiled
    plain = [t for t, _ in gen.generate_step(prompt, model, max_tokens=16)]
    assert plain != theirs
    assert gen.make_processors(None) == [] and gen.make_processors(1.0) == []
    for bad in (0.0, math.nan, math.inf):
        with pytest.raises(UserError, match="repetition-penalty must be above 0"):
            gen.make_processors(bad)


def test_response_carries_the_logprobs_it_sampled_from(tiny):
    model, tok = tiny
    for r in gen.stream_generate(model, tok, "Hi", max_tokens=3):
        assert r.logprobs.shape == (model.args.vocab_size,)
        assert mx.argmax(r.logprobs).item() == r.token  # greedy
        assert abs(mx.logsumexp(r.logprobs).item()) < 1e-4


def test_system_prompt_goes_through_the_chat_template(smollm2):
    model, tok = smollm2
    with_system = gen.encode_prompt(tok, "Hi", system_prompt="You are a pirate.")
    assert with_system == list(tok.apply_chat_template(
        [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True))
    assert with_system != gen.encode_prompt(tok, "Hi")
    with pytest.raises(UserError, match="a system prompt needs a chat template"):
        gen.encode_prompt(tok, "Hi", chat_template=False, system_prompt="You are a pirate.")


def test_chat_template_lets_a_tokenizer_without_one_chat(tiny_llama_dir, spm_model, tmp_path, monkeypatch, capsys):
    """A sentencepiece tokenizer (as a Llama GGUF has) carries no template: chat refuses it; with
    --chat-template FILE (or the text itself) the conversation is rendered by that template."""
    model, tok = load(str(tiny_llama_dir), tokenizer=str(spm_model), norm="rms", progress=False)
    assert not tok.has_chat_template
    with pytest.raises(UserError, match="no chat template: pass one with --chat-template"):
        chat.Chat(model, tok)
    file = tmp_path / "template.jinja"
    file.write_text(TEMPLATE)
    monkeypatch.setattr(chat, "load_from_args", lambda args: (model, gen.set_chat_template(tok, args.chat_template)))
    for value in (str(file), TEMPLATE):
        monkeypatch.setattr("sys.stdin", io.StringIO("hello there\n"))
        chat.main(["--chat-template", value, "--max-tokens", "3"])
        out = capsys.readouterr()
        assert out.err == "" and len(out.out.splitlines()) >= 1
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    assert rendered == tok.encode("<user>hello\n<assistant>", add_special_tokens=False)
    with pytest.raises(UserError, match="no such file, and not a Jinja template"):
        gen.set_chat_template(tok, str(tmp_path / "missing.jinja"))


def test_quantized_kv_cache_8_bit_keeps_the_greedy_tokens(smollm2, monkeypatch):
    """--kv-bits decodes eagerly over mlx-lm's QuantizedKVCache; at 8 bits the embedded model's
    greedy answer is unchanged (measured agreement and perplexity: README)."""
    model, tok = smollm2
    made = []
    eager_cache = gen.eager_cache
    monkeypatch.setattr(gen, "eager_cache", lambda *a: made.append(eager_cache(*a)) or made[-1])
    ref = tokens(model, tok, "What is the capital of France?", 16)
    assert tokens(model, tok, "What is the capital of France?", 16, kv_bits=8) == ref
    assert isinstance(made[0][0], QuantizedKVCache) and made[0][0].bits == 8 and made[0][0].offset > 20
    with pytest.raises(UserError, match="kv-bits must be one of"):
        tokens(model, tok, kv_bits=7)
    with pytest.raises(UserError, match="do not combine"):
        tokens(model, tok, kv_bits=4, max_kv_size=64)


def test_max_kv_size_is_a_rotating_window(tiny):
    """A window larger than the request changes nothing; a small one keeps at most its size in the
    cache while generation goes on past it."""
    model, tok = tiny
    ref = tokens(model, tok, n=20)
    assert tokens(model, tok, n=20, max_kv_size=60) == ref
    cache = gen.eager_cache(model, max_kv_size=16)
    assert isinstance(cache[0], RotatingKVCache)
    out = tokens(model, tok, n=30, cache=cache, chat_template=False)
    assert len(out) == 30 and cache[0].offset > 30 and cache[0].keys.shape[2] == 16


def test_prompt_cache_file_is_reused_and_replaced_atomically(tiny_llama_dir, tmp_path):
    file = tmp_path / "prompt.safetensors"
    base = ("mlx_flashnorm.generate", "--model", str(tiny_llama_dir), "-m", "6", "--ignore-chat-template")
    first = cli(*base, "-p", "one two three four five six", "--prompt-cache-file", str(file))
    assert first.returncode == 0, first.stderr
    assert "prompt cache: 0 of" in first.stderr and file.exists()
    again = cli(*base, "-p", "one two three four five six", "--prompt-cache-file", str(file))
    n = len(json.loads(mx.load(str(file), return_metadata=True)[1]["0.tokens"]))
    assert f"prompt cache: {n - 1} of {n} prompt tokens reused" in again.stderr, again.stderr
    assert again.stdout.split("==========")[0] == first.stdout.split("==========")[0]  # the same text
    plain = cli(*base, "-p", "one two three four five six")
    assert plain.stdout.split("==========")[0] == first.stdout.split("==========")[0]
    other = cli(*base, "-p", "one two three seven", "--prompt-cache-file", str(file))
    assert other.returncode == 0 and "prompt cache: 3 of" in other.stderr, other.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompt.safetensors"]  # no temporary left
    wrong = cli("mlx_flashnorm.generate", "-p", "hi", "-m", "2", "--prompt-cache-file", str(file))
    assert wrong.returncode == 2 and "holds the prompt cache of model" in wrong.stderr
    bad = cli(*base, "-p", "hi", "--prompt-cache-file", str(tmp_path / "p.bin"))
    assert bad.returncode == 2 and "must end in .safetensors" in bad.stderr


def test_prompt_from_standard_input(tiny_llama_dir):
    """`echo TEXT | generate --prompt -` prompts TEXT, as --prompt TEXT does: the trailing newline
    that echo adds is dropped (it made the embedded model answer the France question with
    nonsense)."""
    base = ("mlx_flashnorm.generate", "--model", str(tiny_llama_dir), "-m", "5", "--ignore-chat-template")
    piped = cli(*base, "-p", "-", stdin="once upon a time\n")  # echo's newline is not the prompt's
    given = cli(*base, "-p", "once upon a time")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.split(" tokens,")[0] == given.stdout.split(" tokens,")[0]  # the text, the prompt's size
    empty = cli(*base, "-p", "-", stdin="")
    assert empty.returncode == 2 and "standard input was empty" in empty.stderr


def test_kv_group_size_must_divide_a_head_size_the_config_does_not_state():
    """Qwen 2's config has no head_dim: its head size (hidden / heads = 16 here) is still checked,
    so --kv-group-size 32 is a one-line error, not mx.quantize's at the first step."""
    assert "head_dim" not in QWEN2
    arch, args = model_args(QWEN2)
    with pytest.raises(UserError, match=r"divide the head size \(16\), not 32"):
        gen.eager_cache(arch.Model(args), kv_bits=8, kv_group_size=32)


def test_sampler_and_verbose_as_mlx_lm_takes_them(tiny, capsys):
    """generate and stream_generate take mlx-lm's sampler= (a callable: log-probabilities -> token,
    such as make_sampler's) in place of temp, top_p, top_k and min_p, and generate's verbose=True
    prints what mlx_lm.generate prints: the text between two rules, then the speeds and memory."""
    import re

    from mlx_lm.sample_utils import make_sampler

    model, tok = tiny
    sampled = tokens(model, tok, temp=0.8, top_p=0.9, seed=5)
    assert tokens(model, tok, sampler=make_sampler(0.8, top_p=0.9), seed=5) == sampled
    assert tokens(model, tok, n=3, sampler=lambda logprobs: mx.array([42])) == [42, 42, 42]
    assert gen.generate(model, tok, "Hi", max_tokens=3, sampler=lambda lp: mx.array([42])) == tok.decode([42] * 3)
    with pytest.raises(UserError, match="sampler"):
        tokens(model, tok, sampler=make_sampler(0.8), temp=0.5)
    capsys.readouterr()
    text = gen.generate(model, tok, "Tell me a story.", max_tokens=5, verbose=True)
    out = capsys.readouterr().out
    assert re.fullmatch(r"==========\n(.*)\n==========\nPrompt: \d+ tokens, [\d.]+ tokens-per-sec\n"
                        r"Generation: 5 tokens, [\d.]+ tokens-per-sec\nPeak memory: [\d.]+ GB\n", out, re.S), out
    assert out.split("\n==========\n")[0] == "==========\n" + text
    assert gen.generate(model, tok, "Tell me a story.", max_tokens=5) == text and capsys.readouterr().out == ""
