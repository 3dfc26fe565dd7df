"""Sampling: seeds reproduce, top-k / top-p restrict the support, generation stops at EOS."""
import json
import math
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.sample_utils import make_logits_processors

from mlx_flashnorm import load, stream_generate
from mlx_flashnorm.errors import UserError
from mlx_flashnorm.decoding import generate_step, make_sampler_for
from mlx_flashnorm.loader import build_model, model_args, prepare

from conftest import TINY_LLAMA, f32_tol, random_weights

PROBS = [0.5, 0.3, 0.15, 0.05]
N = 4000


def draw(sampler):
    logprobs = mx.log(mx.array([PROBS] * N))
    counts = [0] * len(PROBS)
    for t in sampler(logprobs).tolist():
        counts[t] += 1
    return [c / N for c in counts]


def test_greedy_is_argmax():
    assert set(draw(make_sampler_for(0.0))) == {1.0, 0.0} and draw(make_sampler_for(0.0))[0] == 1.0


def test_top_k_keeps_the_k_most_likely():
    mx.random.seed(0)
    freq = draw(make_sampler_for(1.0, top_k=2))
    assert freq[2] == freq[3] == 0
    assert abs(freq[0] - 0.5 / 0.8) < 0.05  # renormalised over the kept tokens; ~6 sigma


@pytest.mark.parametrize("top_p, kept", [(0.75, 2), (0.9, 3), (1.0, 4)])
def test_top_p_keeps_the_nucleus(top_p, kept):
    mx.random.seed(0)
    freq = draw(make_sampler_for(1.0, top_p=top_p))
    assert all(f > 0 for f in freq[:kept]) and all(f == 0 for f in freq[kept:])
    assert abs(freq[0] - 0.5 / sum(PROBS[:kept])) < 0.05


def test_min_p_keeps_the_tokens_near_the_likeliest():
    mx.random.seed(0)
    freq = draw(make_sampler_for(1.0, min_p=0.35))  # keeps p >= 0.35 * 0.5: the first two
    assert freq[2] == freq[3] == 0
    assert abs(freq[0] - 0.5 / 0.8) < 0.05


def test_temperature_sharpens():
    mx.random.seed(0)
    freq = draw(make_sampler_for(0.5))
    expected = [p**2 / sum(q**2 for q in PROBS) for p in PROBS]  # temp 0.5 squares the odds
    assert all(math.isclose(f, e, abs_tol=0.05) for f, e in zip(freq, expected))


def test_bad_sampling_arguments():
    for kwargs, message in ((dict(temp=-1), "temp must be at least 0 (0 is greedy) and finite, not -1"),
                            (dict(temp=math.nan), "temp must be at least 0 (0 is greedy) and finite, not nan"),
                            (dict(temp=math.inf), "temp must be at least 0 (0 is greedy) and finite, not inf"),
                            (dict(temp=1, top_p=math.nan), "top-p must be above 0 and at most 1 (1 is off), not nan"),
                            (dict(temp=1, min_p=math.nan), "min-p must be from 0 to 1 (0 is off), not nan"),
                            (dict(temp=1, top_p=0), "top-p must be above 0 and at most 1 (1 is off), not 0"),
                            (dict(temp=1, top_k=-3), "top-k must be at least 0 (0 is off), not -3"),
                            (dict(temp=1, min_p=1.5), "min-p must be from 0 to 1 (0 is off), not 1.5")):
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            make_sampler_for(**kwargs)


def tokens(model, tok, **kwargs):
    return [r.token for r in stream_generate(model, tok, "Tell me a story.", max_tokens=12, **kwargs)]


def test_seed_reproduces_sampled_text(tiny_llama_dir):
    model, tok = load(str(tiny_llama_dir), norm="rms", progress=False)
    a = tokens(model, tok, temp=1.0, seed=7)
    assert a == tokens(model, tok, temp=1.0, seed=7)
    assert a != tokens(model, tok, temp=1.0, seed=8)  # near-uniform over 49152 tokens: never equal


FIRST_DRAWS = """
import json, sys
from mlx_flashnorm import load, stream_generate
model, tok = load(sys.argv[1], norm="rms", progress=False)
for seed in (5, 5):
    print(json.dumps([r.token for r in stream_generate(model, tok, "Tell me a story.", max_tokens=8, temp=1.0,
                                                       top_k=50, seed=seed)]))
"""


def test_seed_reproduces_from_a_process_first_draw(tiny_llama_dir):
    """In a fresh process the first seeded request (the first call of mlx-lm's compiled sampler,
    which carries the global random state) draws what the same request draws after it."""
    done = subprocess.run([sys.executable, "-c", FIRST_DRAWS, str(tiny_llama_dir)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert first == second and len(first) == 8


def test_stops_at_eos_and_reports_stats(smollm2):
    model, tok = smollm2
    out = list(stream_generate(model, tok, "Name a fruit.", max_tokens=100))  # 10 tokens ("Say hello.": 30)
    last = out[-1]
    assert last.finish_reason == "stop" and last.token in tok.eos_token_ids
    assert len(out) < 100 and "<|im_end|>" not in "".join(r.text for r in out)
    assert last.prompt_tokens > 0 and last.generation_tps > 0 and last.peak_memory > 0
    capped = list(stream_generate(model, tok, "Write a long poem.", max_tokens=5))
    assert len(capped) == 5 and capped[-1].finish_reason == "length"


STEPS = 16


@pytest.mark.parametrize("norm", ["rms", "flash"])
def test_logits_processors_apply_as_in_mlx_lm(norm):
    """generate_step's logits_processors see the tokens so far and change the logits before the
    log-softmax, as in mlx-lm's generate_step: the same tokens and log-probabilities, compiled
    (the step returning raw logits) and eager; and the penalties change a greedy output."""
    config = dict(TINY_LLAMA, vocab_size=512)
    arch, args = model_args(config)
    # larger weights than a checkpoint's make the logits spread out, so greedy picks are decisive
    model = prepare(build_model(config, random_weights(arch.Model(args), seed=3, scale=0.2), progress=False), norm)
    prompt = mx.array([5, 17, 5, 17, 5, 17, 9, 5])
    processors = make_logits_processors({3: 2.0}, repetition_penalty=1.6, presence_penalty=0.4,
                                        frequency_penalty=0.3)
    reference = list(mlx_lm_generate_step(prompt, model, max_tokens=STEPS, logits_processors=processors))
    for compiled in (True, False):
        out = list(generate_step(prompt, model, max_tokens=STEPS, compiled=compiled, logits_processors=processors))
        assert [t for t, _ in out] == [t for t, _ in reference], compiled
        assert mx.allclose(mx.stack([lp for _, lp in out]), mx.stack([lp for _, lp in reference]),
                           rtol=f32_tol(1e-4), atol=f32_tol(1e-4)).item(), compiled
    plain = [t for t, _ in generate_step(prompt, model, max_tokens=STEPS)]
    assert plain != [t for t, _ in reference]
