"""Where the whole-step kernel's greedy tokens part from the layer loop's on a test model, whether
the two tokens were a tie: their logits in float32 against the half dtype's rounding there.

    python bench/probes/partings.py NAME:DTYPE:NORM:BITS ... [--steps 24]
    python bench/probes/partings.py qwen2:bfloat16:flash:4 gemma3:bfloat16:rms:0

Each case is tests/test_step_kernel.py's test_kernel_decodes_like_the_blocks: CONFIGS[NAME] of
random weights (quantized_model), the prompt through the model's blocks on both paths, greedy
decoding with kernels.decode_layers and with it disabled. At the first step where the tokens part,
the same weights upcast to float32 (exact) run the common prefix eagerly with our kernels off:
the two tokens' float32 logit gap beside one unit in the last place of DTYPE at the logits'
largest magnitude, where each path rounds its logits. A gap within two such units is a tie that
the half-precision rounding decides (tie); one past it, a computation that differs (NOT A TIE).
The tests' bound is taken at the log-probabilities' magnitude instead (tie_bound), which is
smaller where the logits are large. CUDA only (elsewhere the kernel does not run)."""
import argparse
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("MLX_ENABLE_TF32", "0")  # float32 matmuls in float32 (tests/conftest.py)
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout, and the tests' model builders

import mlx.core as mx  # noqa: E402

from mlx_flashnorm import forms  # noqa: E402
from mlx_flashnorm.decoding import generate_step  # noqa: E402
from test_step_kernel import quantized_model  # noqa: E402

OFF = ("decode_layers", "decode_rows", "prefill_rows", "compiled_prefill")


def greedy(model, prompt, steps):
    out = list(generate_step(prompt, model, max_tokens=steps))
    return [t for t, _ in out], mx.stack([lp.reshape(-1).astype(mx.float32) for _, lp in out])


def verdict(model, prefix, a, b, dtype):
    """(float32 gap of tokens a and b after prefix, one unit of dtype at the logits' magnitude)."""
    model.set_dtype(mx.float32)
    model._compiled_decode = model._compiled_prefill = None
    with forms.without(*OFF):
        logits = model(mx.array(prefix)[None])[0, -1].astype(mx.float32)
    magnitude = mx.abs(logits).max().item()
    unit = 2.0 ** math.floor(math.log2(max(magnitude, 1e-30))) * float(mx.finfo(dtype).eps)
    return abs(logits[a].item() - logits[b].item()), unit, magnitude


def case(spec, steps):
    name, dtype, norm, bits = spec.split(":")
    dtype = getattr(mx, dtype)
    model = quantized_model(name, dtype, bits=int(bits), norm=norm)
    prompt = mx.random.randint(0, model.args.vocab_size, (40,), key=mx.random.key(5))
    with forms.without("prefill_rows"):
        tokens, got = greedy(model, prompt, steps)
        with forms.without("decode_layers"):
            model._compiled_decode = None
            want_tokens, want = greedy(model, prompt, steps)
    s = next((i for i, (x, y) in enumerate(zip(tokens, want_tokens)) if x != y), None)
    if s is None:
        print(f"{spec}: {steps} of {steps} tokens agree")
        return
    a, b = tokens[s], want_tokens[s]
    half = [abs(lp[s, a].item() - lp[s, b].item()) for lp in (got, want)]
    gap, unit, magnitude = verdict(model, prompt.tolist() + tokens[:s], a, b, dtype)
    print(f"{spec}: part at step {s} (kernel {a}, loop {b}); log-prob gaps kernel {half[0]:.4g}, "
          f"loop {half[1]:.4g}; float32 logit gap {gap:.4g}; logits up to {magnitude:.3g}, a unit "
          f"there {unit:.4g} -> {'tie' if gap <= 2 * unit else 'NOT A TIE'}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="+", help="NAME:DTYPE:NORM:BITS (NAME of CONFIGS)")
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args(argv)
    if not (forms.use_gpu("decode_layers") and forms.gpu_backend() == "cuda"):
        print("the whole-step kernel runs on CUDA only: nothing to compare here")
        return
    for spec in args.cases:
        case(spec, args.steps)


if __name__ == "__main__":
    main()
