#!/usr/bin/env bash
# One call on a GPU machine: install, build, GPU tests, and the side-by-side comparison.
#   bash bench/gpu_check.sh            (logs under $OUT, default /tmp/flashoverlap-check)
# Wheels the machine lacks (nvidia-cutlass) may sit in .whl/; a prebuilt kernel cache in .kcache/.
set -uo pipefail
source bench/gpu_env.sh
timeout 300 python3 -m pytest -q -m gpu tests/ > "$OUT/test_gpu.log" 2>&1; tail -3 "$OUT/test_gpu.log"
timeout 300 python3 -m pytest -q -m multigpu tests/ > "$OUT/test_multigpu.log" 2>&1; tail -3 "$OUT/test_multigpu.log"
for transport in ${TRANSPORTS:-nvlink pcie}; do
  bench "bench_$transport" -- --transport "$transport" --shapes ${SHAPES:-4096x8192x8192 8192x8192x8192} \
    --configs ${CONFIGS:-'{}'} --rounds "${ROUNDS:-15}" --csv "$OUT/bench_$transport.csv" \
    ${TRACE:+--trace "$OUT/trace_$transport.json"}
done
