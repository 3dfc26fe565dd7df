"""bench.rows_phases (the batched step kernel's time per phase): a copy of kernels/rows.py loaded
from a file, and its refusal where decode_rows does not run (this CPU). Its stamped kernel is
compiled with the others (test_step_kernel.py, test_cuda_source_compiles); the timings themselves
need the CUDA machine."""
import pytest

from mlx_flashnorm.bench import rows_phases
from mlx_flashnorm.errors import UserError
from mlx_flashnorm.kernels import rows

from conftest import cli


def test_a_copy_of_the_kernel_source_loads_beside_the_current_one(tmp_path):
    copy = tmp_path / "rows_copy.py"
    copy.write_text(open(rows.__file__).read().replace("GMAX = 16 ", "GMAX = 32 "))
    variant = rows_phases.rows_module(str(copy))
    assert variant.GMAX == 32 and rows.GMAX == 16 and rows_phases.rows_module(None) is rows
    assert variant.rows_per_pass(64, 576, 1536) == (32, 16, 1536) != rows.rows_per_pass(64, 576, 1536)
    with pytest.raises(UserError, match="no layer loop or grid barrier"):
        rows_phases.stamped_source("__global__ void k() {}")


def test_refuses_where_decode_rows_does_not_run():
    if rows_phases.step.use_decode_layers("decode_rows"):
        pytest.skip("decode_rows runs here")
    r = cli("mlx_flashnorm.bench.rows_phases", "--rows", "32")
    assert r.returncode != 0 and r.stderr.startswith("error: decode_rows runs on CUDA only")
    assert "Traceback" not in r.stderr
