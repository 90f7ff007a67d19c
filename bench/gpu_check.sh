#!/usr/bin/env bash
# One call on a GPU machine: install, build, GPU tests, stress, and the side-by-side comparisons.
#   bash bench/gpu_check.sh            (logs under $OUT, default /tmp/flashoverlap-check)
# Wheels the machine lacks (nvidia-cutlass) may sit in .whl/; a prebuilt kernel cache in .kcache/.
set -uo pipefail
source bench/gpu_env.sh
timeout 300 python3 -m pytest -q -m gpu tests/ > "$OUT/test_gpu.log" 2>&1; tail -3 "$OUT/test_gpu.log"
timeout 300 python3 -m pytest -q -m multigpu tests/ > "$OUT/test_multigpu.log" 2>&1; tail -3 "$OUT/test_multigpu.log"
timeout 600 torchrun --nproc-per-node "$NGPU" tests/stress_overlap.py --calls "${STRESS_CALLS:-10000}" \
  > "$OUT/stress.log" 2>&1; tail -2 "$OUT/stress.log"
for transport in ${TRANSPORTS:-nvlink pcie}; do
  bench "all_reduce_$transport" -- --transport "$transport" --shapes ${SHAPES:-4096x8192x8192 8192x8192x8192} \
    --configs ${CONFIGS:-'{}'} --rounds "${ROUNDS:-15}" --csv "$OUT/all_reduce_$transport.csv" \
    ${TRACE:+--trace "$OUT/trace_$transport.json"}
  bench "reduce_scatter_$transport" -- --transport "$transport" --collective reduce_scatter \
    --shapes 16384x8192x4096 --rounds "${ROUNDS:-15}" --csv "$OUT/reduce_scatter_$transport.csv"
  bench "all_to_all_$transport" -- --transport "$transport" --collective all_to_all \
    --shapes 8192x4096x7168 --rounds "${ROUNDS:-15}" --csv "$OUT/all_to_all_$transport.csv"
done
# The Ampere/Ada kernels forced on Hopper, NCCL through host memory (the consumer-GPU stand-in),
# beside the Hopper kernels in the same run.
bench sm80_pcie -- --transport pcie --shapes 8192x4096x14336 4096x8192x8192 --rounds "${ROUNDS:-15}" \
  --configs '{}' '{"kernel": "sm80"}' '{"kernel": "sm80", "comm_sms": 8}' '{"kernel": "sm80", "tile_n": 128}' \
  --csv "$OUT/sm80_pcie.csv"
