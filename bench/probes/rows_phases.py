"""GPU time of each phase of kernels.decode_rows (the batched server's step), per layer, or of
kernels.decode_layers (the one-row step: --kernel decode_layers).

    python bench/probes/rows_phases.py [--rows 8,16,32,64] [--positions 64,300] [--source FILE ...]
    python bench/probes/rows_phases.py --kernel decode_layers [--positions 64,300] [--source ...]

The kernel is one launch with a grid barrier between its phases, so a profiler sees one duration.
This probe builds a variant of it in which block 0 reads the GPU's nanosecond clock (globaltimer)
after every barrier and writes the reading past the end of the work buffer; a phase's time is the
gap between two readings (its own work and the barrier that ends it). It runs the embedded
SmolLM2-135M in float16 on random caches, every row at the same position, and prints the median
over --reps launches of each phase's mean over the layers, in microseconds. --source times the
kernel of another copy of kernels/rows.py (or kernels/step.py: another GMAX, a changed phase; one
with launch_plan, source and SIZES, or source and SIZES) beside the current one; the copy reads
its CUDA from the cuda/ folder beside it (copy the kernels folder to change a phase). --blocks
launches each at other grid sizes (one block an SM by default): what the grid barriers cost
against the blocks' work."""
import argparse
import importlib.util
import sys
from pathlib import Path

# the package of the checkout this script is in, not another installed copy: the probe reaches
# into kernel internals that change with the code
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlx_flashnorm.bench.decode import device_name  # noqa: E402
from mlx_flashnorm.errors import HelpFormatter, UserError, run_cli  # noqa: E402
from mlx_flashnorm.flashnorm.stack import _spec, _stacked  # noqa: E402
from mlx_flashnorm.kernels import rows as current, step  # noqa: E402
from mlx_flashnorm.kernels.build import make_kernel  # noqa: E402
from mlx_flashnorm.loader import load  # noqa: E402

# the phase each barrier ends (merge: about nothing where it is skipped)
PHASES = ["qkv", "attention", "merge", "o_proj", "gate_up", "down"]
# decode_layers' (kernels/step.py): the splits merged inside o_proj's phase
LAYER_PHASES = ["qkv", "attention", "o_proj", "gate_up", "down"]
STAMP = ("if (blockIdx.x == 0 && threadIdx.x == 0) { unsigned long long t_; "
         "asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t_)); "
         "reinterpret_cast<unsigned long long*>(stamps_)[ti_++] = t_; }")


def rows_module(path, base=current):
    """kernels/rows.py (base: or kernels/step.py), or the copy at path (its relative imports
    resolved in mlx_flashnorm.kernels)."""
    if not path:
        return base
    name = f"mlx_flashnorm.kernels.{base.__name__.rsplit('.', 1)[-1]}_variant"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise UserError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stamped_source(source):
    """The rows kernel's body with a clock reading before the layers, after every grid barrier and
    at the end, into the float pairs from work + WORK_ on."""
    head, barrier = "for (int l = 0; l < NL; ++l) {", "fn_grid_sync(bar, target += NB);"
    if head not in source or barrier not in source:
        raise UserError("this rows kernel has no layer loop or grid barrier where the stamps go")
    source = source.replace(barrier, barrier + " " + STAMP)
    start = "float* stamps_ = work + WORK_; int ti_ = 0; "
    source = source.replace(head, start + STAMP + "\n  " + head, 1)
    return source.replace("  fn_grid_exit(bar, NB);", "  " + STAMP + "\n  fn_grid_exit(bar, NB);")


def stamped_kernel(module, layers, tag):
    body, header = module.source(layers)
    name = "layers" if module.SIZES == step.SIZES else "rows"  # (rows.py's table adds the rows)
    return make_kernel(f"fn_decode_{name}_stamped{tag}", step.input_names(layers),
                       ["y", "p", "ys", "work"], stamped_source(body), header)


def phase_times(module, kernel, spec, B, position, reps, capacity=1024):
    """Median over reps of each phase's mean over the layers (us), of the whole launch (us), and
    the launch's template (rows per pass)."""
    L, HQ, HKV = len(spec["layers"]), spec["n_heads"], spec["n_kv_heads"]
    D = spec["theta"].shape[-1] * 2
    K, I = spec["layers"][0][1][0].shape[0], spec["layers"][0][2][0].shape[0] // 2
    caches = [tuple(0.5 * mx.random.normal((B, HKV, capacity, D)).astype(mx.float16)
                    for _ in range(2))
              for _ in range(L)]
    x = mx.random.normal((B, 1, K)).astype(mx.float16)
    positions = mx.full((B,), position, mx.int32)
    if module.SIZES == step.SIZES:  # decode_layers (kernels/step.py or a copy): one row
        work = (HQ + 2 * HKV) * D + HQ * step.SMAX * (D + 2) + K + I
        template, names = step.layout(K, max(K, HQ * D, I)), LAYER_PHASES
        shared = step.shared_bytes(K, max(K, HQ * D, I), spec["bits"], D, HQ // HKV, L)
    else:
        template, work, shared = module.launch_plan(B, K, I, D, HQ, HKV, L)
        names = PHASES
    P = len(names)
    # one before the layers, one after each of a layer's phases, one at the end: pairs of floats
    # after the work
    stamps = 2 + P * L

    def once():
        *_, scratch = step.launch(kernel, x, positions, caches=caches, work=work + 2 * stamps,
                                  shared_memory=shared, fields=module.SIZES,
                                  template=template + [("WORK_", work)], keep_work=True, **spec)
        return np.frombuffer(np.array(scratch[work:]).tobytes(), dtype=np.uint64).astype(np.int64)

    once()  # untimed: the first launch loads the binary
    t = np.array([once() for _ in range(reps)])
    per_layer = np.diff(t[:, :1 + P * L], axis=1).reshape(reps, L, P).mean(axis=1) / 1e3
    return np.median(per_layer, axis=0), float(np.median(t[:, -1] - t[:, 0])) / 1e3, dict(template)


def arg_parser():
    p = argparse.ArgumentParser(prog="python bench/probes/rows_phases.py",
                                description=__doc__.split("\n\n")[1], formatter_class=HelpFormatter)
    p.add_argument("--rows", default="8,16,32,64", help="comma-separated batch sizes")
    p.add_argument("--positions", default="64,300",
                   help="comma-separated positions (every row at it)")
    p.add_argument("--reps", type=int, default=20, help="timed launches per point")
    p.add_argument("--source", nargs="*", default=[],
                   help="other copies of kernels/rows.py (or step.py) to time beside it")
    p.add_argument("--kernel", choices=["decode_rows", "decode_layers"], default="decode_rows",
                   help="the batched kernel, or the one-row one (one row: --rows unused)")
    p.add_argument("--blocks", default="",
                   help="comma-separated grid sizes to launch with (default: one block an SM): "
                        "fewer blocks meet at cheaper barriers and do more work each")
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    return p


def main(argv=None):
    args = arg_parser().parse_args(argv)
    if not step.use_decode_layers(args.kernel):
        raise UserError(f"{args.kernel} runs on CUDA only (sm_80 on, our kernels on): run this on "
                        "the GPU machine")
    try:
        counts = [int(v) for v in args.rows.split(",")]
        positions = [int(v) for v in args.positions.split(",")]
        blocks = [int(v) for v in args.blocks.split(",")] if args.blocks else [step.sm_count()]
    except ValueError:
        raise UserError("--rows, --positions and --blocks take whole numbers separated by commas")
    if min(blocks) < 1 or max(blocks) > step.sm_count():
        raise UserError(f"--blocks must lie in 1..{step.sm_count()} (one block an SM at most: the "
                        "blocks of a grid barrier all run at once)")
    if (min(counts) < 2 or max(counts) > step.MAX_ROWS
            or min(positions) < 0 or max(positions) >= 1023):
        raise UserError(f"--rows must lie in 2..{step.MAX_ROWS} and --positions in 0..1022")
    one_row = args.kernel == "decode_layers"
    counts, names = ([1], LAYER_PHASES) if one_row else (counts, PHASES)
    model, _ = load(None, dtype="float16", progress=False)
    spec = _spec(model.layers)
    # the loader's stacks, as the step passes them
    spec["layers"] = _stacked(model.layers, spec["layers"])
    print(f"{device_name()}, MLX {mx.__version__}, SmolLM2-135M float16, "
          f"{args.reps} launches a point\n")
    print("| kernel | blocks | rows | position | G, GD, GU, NW | " + " | ".join(names)
          + " | layer | step |")
    print("| --- | ---: | ---: | ---: | --- |" + " ---: |" * (len(names) + 2))
    sm_count = step.sm_count
    for i, source in enumerate([None] + args.source):
        module = rows_module(source, step if one_row else current)
        kernel = stamped_kernel(module, len(spec["layers"]), i)
        for nb, B, position in ((nb, B, p) for nb in blocks for B in counts for p in positions):
            step.sm_count = lambda: nb  # the launch's grid and its NB
            try:
                phases, total, plan = phase_times(module, kernel, spec, B, position, args.reps)
            finally:
                step.sm_count = sm_count
            # an older copy's plan may lack GU and NW: its gate/up pass and its warps as then
            passes = ("-" if one_row else f"{plan['G']}, {plan['GD']}, "
                      f"{plan.get('GU', plan['G'])}, {plan.get('NW', 8)}")
            print(f"| {source or 'current'} | {nb} | {B} | {position} | {passes} | "
                  + " | ".join(f"{v:.1f}" for v in phases)
                  + f" | {phases.sum():.1f} | {total:.0f} |", flush=True)


if __name__ == "__main__":
    run_cli(main)
