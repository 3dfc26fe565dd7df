"""Each kernel's first-use self-check: at load on a GPU (self_check) every kernel is compared with
its plain-MLX fallback on small float16 inputs (each kernel file's CHECK); one that fails to
compile or to match prints a warning line and falls back for the rest of the process
(forms.DISABLED). A pass is remembered per kernel code, MLX version and device (nvrtc.CACHE_DIR),
so later processes skip it: a check costs seconds per kernel even with MLX's kernel cache warm
(bench/RESULTS.md, "Self-check cost"). A changed kernel file, MLX or GPU is checked again; a failed
check is never kept."""
import hashlib
import json
import sys
from pathlib import Path

import mlx.core as mx

from .. import forms
from . import nvrtc
from .scale import CHECK as ADD_RSS
from .attention import CHECK as ATTENTION
from .matvec import CHECKS as MATVEC
from .normalize import CHECK as NORMALIZE
from .rope import CHECK as ROPE_QKV
from .step import CHECK as DECODE_LAYERS
from .rows import CHECK as DECODE_ROWS, PREFILL_CHECK as PREFILL_ROWS

# name: (a call on small float16 inputs, the largest max |kernel - fallback| / max |fallback|)
CHECKS = {"add_rss": ADD_RSS, "decode_attention": ATTENTION, "rope_qkv": ROPE_QKV,
          "normalize": NORMALIZE, **MATVEC, "decode_layers": DECODE_LAYERS,
          "decode_rows": DECODE_ROWS, "prefill_rows": PREFILL_ROWS}


def _passed_file():
    folder = Path(__file__).parent  # the kernels' Python and CUDA files
    files = sorted([*folder.glob("*.py"), *folder.glob("cuda/*")])
    key = hashlib.sha256(b"".join(p.read_bytes() for p in files))
    key.update(f"{mx.__version__} {forms.gpu_backend()} {mx.default_device()} "
               f"{mx.device_info().get('device_name', '')}".encode())
    return nvrtc.CACHE_DIR / f"self-check-{key.hexdigest()[:20]}.json"


def _read_passed(file):
    """The names kept in file; a file of any other content (not a JSON list of names), or no
    regular file there (nvrtc.read_cached), is treated as absent."""
    try:
        names = json.loads(nvrtc.read_cached(file) or b"")
    except (ValueError, RecursionError):  # b"" (a miss) is not JSON either
        return set()
    return (set(names) if isinstance(names, list) and all(isinstance(n, str) for n in names)
            else set())


def _write_passed(file, passed):
    # a temporary file renamed into place; a read-only cache only costs the next process time
    nvrtc.write_cached(file, json.dumps(sorted(passed)).encode())


def self_check(names=None):
    """Run each kernel (or those named) once on small inputs against its plain-MLX fallback on the
    device in use; a kernel that fails to compile or to match prints one warning line and falls
    back for the rest of the process. Runs once per process (the loader calls it on a GPU; the LAZY
    ones only when named); a kernel that passed with the same code, MLX and device before
    (CACHE_DIR) is not run again."""
    todo = [n for n in dict.fromkeys(names or [n for n in CHECKS if n not in LAZY])
            if n not in _CHECKED and n not in forms.DISABLED]  # not checked already, nor off anyway
    if not todo:  # (flashnorm.decode_stack asks at every trace: no file read then)
        return not forms.DISABLED
    file = _passed_file()
    passed = _read_passed(file)
    known = set(passed)
    for name in todo:
        _CHECKED.add(name)
        if name in passed:
            continue
        call, tol = CHECKS[name]
        outputs = lambda: [a for a in (lambda o: o if isinstance(o, (tuple, list)) else [o])(call())
                           if a is not None]
        try:
            got = outputs()
            forms.DISABLED.add(name)  # the same call through the fallback
            want = outputs()
            forms.DISABLED.discard(name)
            err = max((mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()
                       / mx.abs(b.astype(mx.float32)).max()).item() for a, b in zip(got, want))
            why = None if err <= tol else f"differs from its fallback by {err:.2e} (> {tol:g})"
        except Exception as e:  # a compile or launch error
            why = (f"{type(e).__name__}: "
                   f"{str(e).strip().splitlines()[0] if str(e).strip() else 'no detail'}")
        if why:
            forms.DISABLED.add(name)
            print(f"warning: kernel {name} failed its self-check on {mx.default_device()} ({why}); "
                  "using the plain MLX fallback", file=sys.stderr)
        else:
            passed.add(name)
    if passed != known:
        _write_passed(file, passed)
    return not forms.DISABLED


_CHECKED = set()
# checked where first needed, not at load: decode_rows (the batched server's step: its compile and
# check cost seconds no one-request user needs) and prefill_rows are checked by
# flashnorm.decode_stack before their first batch or prompt
LAZY = {"decode_rows", "prefill_rows"}
