"""bench/probes/rows_phases.py (the whole-step kernels' time per phase, batched or one-row): a copy of
kernels/rows.py loaded from a file, and its refusal where decode_rows does not run (this CPU). Its
stamped kernel is compiled with the others (test_step_kernel.py, test_cuda_source_compiles); the
timings themselves need the CUDA machine."""
import subprocess
import sys

import mlx.core as mx
import pytest

from mlx_flashnorm import forms
from mlx_flashnorm.errors import UserError
from mlx_flashnorm.kernels import build, rows, stacks, step

from conftest import PROBES, probe

rows_phases = probe("rows_phases")


def test_a_copy_of_the_kernel_source_loads_beside_the_current_one(tmp_path):
    copy = tmp_path / "rows_copy.py"
    copy.write_text(open(rows.__file__).read().replace("GMAX = 16 ", "GMAX = 32 "))
    variant = rows_phases.rows_module(str(copy))
    assert variant.GMAX == 32 and rows.GMAX == 16 and rows_phases.rows_module(None) is rows
    assert variant.rows_per_pass(64, 576, 1536) == (32, 16, 1536) != rows.rows_per_pass(64, 576, 1536)
    with pytest.raises(UserError, match="no layer loop or grid barrier"):
        rows_phases.stamped_source("__global__ void k() {}")
    (tmp_path / "cuda").mkdir()  # a copy's CUDA: the cuda/ folder beside it
    for f in rows.CUDA.iterdir():
        (tmp_path / "cuda" / f.name).write_text(f.read_text().replace("// 4. per row: o_proj",
                                                                      "// 4. changed: o_proj"))
    assert "4. changed" in variant.source(2)[0] and "4. changed" not in rows.source(2)[0]


def stubbed(monkeypatch):
    """MLX's precompiled launcher stubbed, with the compiler, as in test_step_kernel.py: (the
    launches' keyword arguments, the CUDA sources compiled), filled as launches come."""
    calls, files = [], []
    monkeypatch.setattr(build, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(step, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(forms, "use_gpu", lambda name=None: True)
    monkeypatch.setattr(step, "sm_count", lambda: 132)
    monkeypatch.setattr(build, "cuda_binary", lambda name, code: files.append(code) or b"cubin")
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", lambda **kw: calls.append(kw) or
                        [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])])
    return calls, files


def test_the_timed_launch_is_decode_rows_launch_with_room_for_the_stamps(monkeypatch):
    """phase_times' launch as it reaches MLX's precompiled launcher (stubbed, with the compiler, as
    in test_step_kernel.py): decode_rows' inputs, template and work buffer (rows.launch_plan), the
    stamps' place (WORK_) at its end and room for two floats a stamp after it."""
    calls, files = stubbed(monkeypatch)
    L, K, HQ, HKV, D, I, C, B = 3, 256, 4, 2, 64, 384, 64, 5
    layers, _ = stacks.random_stack(L, K, HQ, HKV, D, I, C, 9, 80)
    layers = [tuple((w, s.astype(mx.float16), b.astype(mx.float16)) for w, s, b in m) for m in layers]
    spec = dict(layers=layers, gains=None, qk_gains=None, theta=mx.zeros((D // 2,)), eps=1e-5, factor=0.5,
                qk_eps=0.0, n_heads=HQ, n_kv_heads=HKV, group_size=64, bits=4)
    kernel = rows_phases.stamped_kernel(rows, L, "test")
    phases, total, plan = rows_phases.phase_times(rows, kernel, spec, B, 9, reps=2, capacity=C)
    template, work, shared = rows.launch_plan(B, K, I, D, HQ, HKV, L)
    assert len(calls) == 3 and all(len(c["inputs"]) == 7 + len(step.STACKED) + 2 * L
                               for c in calls)  # untimed, then reps
    assert calls[0]["output_shapes"][3] == (work + 2 * (2 + 6 * L),) and calls[0]["shared_memory"] == shared
    assert plan == dict(template) == {"XA": K, "G": 8, "GD": 8, "GU": 8, "IC": I, "NW": rows.WARPS}
    assert f"constexpr int WORK_ = {work};" in files[0] and files[0].count("ti_++") == 2 + 5 + 1
    assert phases.shape == (6,) and total == 0.0  # the stub's clock never moves


def test_the_one_row_launch_is_decode_layers_launch(monkeypatch, tmp_path):
    """--kernel decode_layers: the one-row kernel's launch (stubbed as above) with decode_layers'
    work buffer and shared memory, a stamp after each of its five phases; a copy of kernels/step.py
    loads beside it."""
    calls, files = stubbed(monkeypatch)
    L, K, HQ, HKV, D, I, C = 2, 256, 4, 2, 64, 384, 64
    layers, _ = stacks.random_stack(L, K, HQ, HKV, D, I, C, 9, 81)
    layers = [tuple((w, s.astype(mx.float16), b.astype(mx.float16)) for w, s, b in m)
              for m in layers]
    spec = dict(layers=layers, gains=None, qk_gains=None, theta=mx.zeros((D // 2,)), eps=1e-5,
                factor=0.5, qk_eps=0.0, n_heads=HQ, n_kv_heads=HKV, group_size=64, bits=4)
    kernel = rows_phases.stamped_kernel(step, L, "one")
    phases, total, plan = rows_phases.phase_times(step, kernel, spec, 1, 9, reps=2, capacity=C)
    work = (HQ + 2 * HKV) * D + HQ * step.SMAX * (D + 2) + K + I
    assert len(calls) == 3 and calls[0]["output_shapes"][3] == (work + 2 * (2 + 5 * L),)
    assert calls[0]["shared_memory"] == step.shared_bytes(K, I, 4, D, HQ // HKV, L)
    assert "fn_decode_layers_stamped" in calls[0]["name"] and plan == dict(step.layout(K, I))
    assert files[0].count("ti_++") == 2 + 5 and phases.shape == (5,)
    copy = tmp_path / "step_copy.py"
    copy.write_text(open(step.__file__).read().replace("SMAX = 16 ", "SMAX = 8 "))
    assert rows_phases.rows_module(str(copy), step).SMAX == 8 and step.SMAX == 16


def test_refuses_where_decode_rows_does_not_run():
    if rows_phases.step.use_decode_layers("decode_rows"):
        pytest.skip("decode_rows runs here")
    r = subprocess.run([sys.executable, str(PROBES / "rows_phases.py"), "--rows", "32"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and r.stderr.startswith("error: decode_rows runs on CUDA only")
    assert "Traceback" not in r.stderr
