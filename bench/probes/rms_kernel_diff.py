"""The whole-step kernel (decode_layers) against the layer loop it replaces, step by step.

    python bench/probes/rms_kernel_diff.py [--steps 40] [--norms rms,flash]
                                           [--dtypes float16,bfloat16]

For the embedded SmolLM2-135M (Q4_1 GGUF) in each norm mode and dtype: greedy decoding with the
kernel, then with it disabled (the compiled layer loop, as test_step_kernel.py's
test_kernel_on_real_weights compares them). Per decode step while the tokens agree, the largest
|log-probability difference| of the two paths over the vocabulary; at the first differing token,
each path's gap between the two tokens' log-probabilities and its own top-2 gap, beside the tie
bound of the tests (4 units of the dtype's last place at 2). A gap within the bound is a tie that
summation order decides; one past it, with per-step differences of about that size before, is a
computation that differs. CUDA only (elsewhere the kernel does not run)."""
import argparse
import sys
from pathlib import Path

# the package of the checkout this script is in, not another installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402

from mlx_flashnorm import forms  # noqa: E402
from mlx_flashnorm.decoding import generate_step  # noqa: E402
from mlx_flashnorm.flashnorm import stack  # noqa: E402
from mlx_flashnorm.loader import load  # noqa: E402

PROMPT = "The capital of France is Paris. The capital of Germany is"


def decode(model, prompt, steps):
    """Greedy tokens and per-step log-probabilities (float32, steps x vocabulary)."""
    out = list(generate_step(prompt, model, max_tokens=steps))
    return [t for t, _ in out], mx.stack([lp.reshape(-1).astype(mx.float32) for _, lp in out])


def compare(norm, dtype, steps):
    model, tok = load(None, norm=norm, dtype=dtype, progress=False)
    spec = stack._spec(model.layers)
    prompt = mx.array(tok.encode(PROMPT))
    got_tokens, got = decode(model, prompt, steps)
    saved = forms.DISABLED
    forms.DISABLED = saved | {"decode_layers"}
    try:
        model._compiled_decode = None
        want_tokens, want = decode(model, prompt, steps)
    finally:
        forms.DISABLED = saved
        model._compiled_decode = None
    bound = 4 * 2 * float(mx.finfo(getattr(mx, dtype)).eps)
    n = next((s for s, (a, b) in enumerate(zip(got_tokens, want_tokens)) if a != b), steps)
    diffs = mx.abs(got[:n] - want[:n]).max(axis=-1).tolist() if n else []
    print(f"{norm} {dtype} (spec {spec and spec['norm']}): {n}/{steps} tokens agree; tie bound "
          f"{bound:.4g}")
    print("  max |dlogprob| per step: " + " ".join(f"{d:.3g}" for d in diffs))
    if n < steps:
        a, b = got_tokens[n], want_tokens[n]
        for name, lp in (("kernel", got), ("loop", want)):
            top = mx.sort(lp[n])[-2:].tolist()
            print(f"  step {n}: {name}: lp[{a}] = {lp[n, a].item():.5f}, lp[{b}] = "
                  f"{lp[n, b].item():.5f}, gap {abs(lp[n, a].item() - lp[n, b].item()):.4g}, "
                  f"top-2 gap {top[1] - top[0]:.4g}")
        gap = max(abs(lp[n, a].item() - lp[n, b].item()) for lp in (got, want))
        print(f"  -> {'TIE' if gap <= bound else 'NOT A TIE'} (gap {gap:.4g}, bound {bound:.4g})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--norms", default="rms,flash")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    args = parser.parse_args(argv)
    if not (forms.use_gpu("decode_layers") and forms.gpu_backend() == "cuda"):
        print("the whole-step kernel runs on CUDA only: nothing to compare here")
        return
    for norm in args.norms.split(","):
        for dtype in args.dtypes.split(","):
            compare(norm, dtype, args.steps)


if __name__ == "__main__":
    main()
