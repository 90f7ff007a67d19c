#!/usr/bin/env bash
# On a GPU machine: install, build, then the chosen steps (default: all; ~25 min on 2x H200, so
# run a few steps per call where calls are time-limited).
#   bash bench/gpu_check.sh [tests] [stress] [bench] [sm80] [swizzle] [tune] [brute] [suite] [graphs] [small] [host] [symm] [fp8]
# STOP_AFTER_S: start no step once this many seconds have passed (where the call that runs this is
# killed at a time limit, the archive below is made only if the script ends by itself).
# Logs and CSVs in $OUT/flashoverlap-results.tgz ($OUT default /tmp/flashoverlap-check). Wheels the machine lacks
# (nvidia-cutlass) may sit in .whl/; a prebuilt kernel cache in .kcache/ (python -m flashoverlap.precompile).
#   tests   GPU and multi-GPU tests (both kernel families; GPU_TESTS=0: multi-GPU ones only; MULTIGPU_K: a
#           pytest -k part of those, MULTIGPU_TIMEOUT seconds, default 540)
#   stress  10,000 random calls checked against the sequential path (STRESS_CALLS)
#   bench   each collective, NVLink and P2P off: all-reduce with CONFIGS (default: the registry and the
#           defaults) and late budgets, reduce-scatter / all-to-all with the registry, the defaults, the
#           rows and segments layouts (COLLECTIVES, SHAPES, ROUNDS, TRACE); windows over NVLink only;
#   sm80    the Ampere/Ada kernels forced on Hopper, P2P off: tuned (registry in $OUT/sm80), beside the Hopper ones
#   swizzle each collective (COLLECTIVES) over NVLink with swizzled rasters beside the plain one
#   tune    the tuner on bench/suite.yaml, TUNE_COLLECTIVES (all_reduce), NVLink and P2P off (TRANSPORTS) ->
#           $OUT/tuned/$REGISTRY (this machine's file of flashoverlap/configs/, e.g. h200_x2.yaml: a copy, updated); TUNE_ARGS: more tuner
#           arguments (JSON without spaces, e.g. --candidates {} {"reduction":"local","symmetric":true,"comm_sms":0})
#   brute   the tuner with --brute-force 4 on two shapes: its pick against the best measured
#   suite   bench/suite.yaml with the registry's configs beside the defaults ($OUT/tuned first if there),
#           for SUITE_COLLECTIVES (all_reduce), NVLink and P2P off (TRANSPORTS), INPUTS (rotated; hot, both)
#   graphs  bench/suite.yaml with the registry and CONFIGS, c10d and direct NCCL, every block of calls one
#           CUDA graph replay (GPU time only), for SUITE_COLLECTIVES (all_reduce), TRANSPORTS (nvlink pcie)
#   small   bench/small.yaml (M 8-2048) for every collective, eager and as CUDA graphs, hot and rotated
#           inputs, the registry's path (untuned: timed on first use) and the forced fallback beside seq
#           (SMALL_COLLECTIVES, SMALL_MODES); NVLink
#   host    host time per call of each path on a host-bound shape, and where it goes (bench/host_profile.py);
#           a replayed pull reduce-scatter's pieces (bench/replay_profile.py)
#   symm    NCCL ring vs symmetric-memory vs copy-engine kernels on a few CTAs beside the GEMM
#           (bench/symmetric_probe.py; NCCL's kernel choices in symm.log)
#   fp8     FP8 e4m3 (per-tensor scales, bf16 out): the kernels alone against cuBLAS (bench/fp8_probe.py,
#           one GPU), then the all-reduce suite untuned against torch._scaled_mm + the collective,
#           promoted and fast accumulation, for TRANSPORTS (nvlink pcie); six reduce-scatter shapes
#           beside torch async-TP's FP8 op (NVLink)
set -uo pipefail
source bench/gpu_env.sh
steps=${*:-tests stress bench sm80 swizzle tune brute suite}
# Everything under $OUT leaves as one archive (a device call returns few files).
trap 'tar -C "$OUT" -czf /tmp/flashoverlap-results.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/flashoverlap-results.tgz "$OUT/"' EXIT
for step in $steps; do
  if [ -n "${STOP_AFTER_S:-}" ] && [ "$SECONDS" -ge "$STOP_AFTER_S" ]; then
    echo "STOP_AFTER_S=$STOP_AFTER_S passed ($SECONDS s): $step and the steps after it not run"; break
  fi
  case $step in
  tests)
    if [ "${GPU_TESTS:-1}" = 1 ]; then  # GPU_TESTS=0: the multi-GPU tests only (the others ran on one GPU)
      timeout 300 python3 -m pytest -q -m gpu tests/ > "$OUT/test_gpu.log" 2>&1; tail -3 "$OUT/test_gpu.log"
    fi
    # the whole set took ~470 s on 2x H200 (19 tests): MULTIGPU_K="expr" runs a part (pytest -k)
    timeout "${MULTIGPU_TIMEOUT:-540}" python3 -m pytest -q -m multigpu tests/ --durations=10 ${MULTIGPU_K:+-k "$MULTIGPU_K"} \
      > "$OUT/test_multigpu.log" 2>&1
    tail -15 "$OUT/test_multigpu.log" ;;
  stress)
    timeout 600 torchrun --nproc-per-node "$NGPU" tests/stress_overlap.py --calls "${STRESS_CALLS:-10000}" \
      > "$OUT/stress.log" 2>&1; tail -2 "$OUT/stress.log" ;;
  bench)
    wants() { [[ " ${COLLECTIVES:-all_reduce reduce_scatter all_to_all} " == *" $1 "* ]]; }
    for transport in ${TRANSPORTS:-nvlink pcie}; do
      sym=()  # symmetric windows need peer access: NVLink only
      [ "$transport" = nvlink ] && sym=('{"symmetric": true}' '{"symmetric": true, "comm_sms": 4}')
      late=('{"late_budget": true}')  # NCCL's SMs from the last waves on; in a window over NVLink
      [ "$transport" = nvlink ] && late+=('{"late_budget": true, "symmetric": true}')
      gather=('{"reduction": "local"}')  # all-gathered partial sums (copy engines with symmetric windows)
      [ "$transport" = nvlink ] && gather+=('{"reduction": "local", "symmetric": true, "comm_sms": 0}' \
        '{"reduction": "local", "symmetric": true, "comm_sms": 4}')  # 4 SMs for the adds, the GEMM's waves kept
      wants all_reduce && bench "all_reduce_$transport" -- --transport "$transport" --shapes ${SHAPES:-4096x8192x8192 8192x8192x8192} \
        --configs ${CONFIGS:-registry '{}'} "${late[@]}" "${sym[@]}" "${gather[@]}" --nccl c10d direct \
        --rounds "${ROUNDS:-15}" --csv "$OUT/all_reduce_$transport.csv" \
        ${TRACE:+--trace "$OUT/trace_$transport.json"}
      rows=('{"layout": "rows"}' '{"layout": "rows", "comm_sms": 4}' '{"layout": "rows", "comm_sms": 24}'
            '{"layout": "segments"}' '{"layout": "segments", "comm_sms": 4}')
      seg=()  # segments in a window: NCCL's symmetric reduce-scatter / copy-engine all-to-all
      [ "$transport" = nvlink ] && seg=('{"layout": "segments", "symmetric": true, "comm_sms": 4}'
        '{"layout": "rows", "late_budget": true, "symmetric": true}')
      wants reduce_scatter && bench "reduce_scatter_$transport" -- --transport "$transport" --collective reduce_scatter \
        --shapes 16384x8192x4096 --configs registry '{}' "${rows[@]}" "${sym[@]}" "${seg[@]}" \
        --rounds "${ROUNDS:-15}" --csv "$OUT/reduce_scatter_$transport.csv"
      wants all_to_all && bench "all_to_all_$transport" -- --transport "$transport" --collective all_to_all \
        --shapes 8192x4096x7168 --configs registry '{}' "${rows[@]}" "${sym[@]}" ${sym:+'{"symmetric": true, "comm_sms": 0}'} \
        "${seg[@]}" ${seg:+'{"layout": "segments", "symmetric": true, "comm_sms": 0}'} \
        --rounds "${ROUNDS:-15}" --csv "$OUT/all_to_all_$transport.csv"
    done ;;
  sm80)
    # the tuner's pick for the Ampere/Ada kernels (a registry of their own, $OUT/sm80), then the bench
    mkdir -p "$OUT/sm80"
    timeout 300 torchrun --nproc-per-node "$NGPU" -m flashoverlap.tune --collective all_reduce --transport pcie --top 6 \
      --shapes 8192x4096x14336 --candidates '{"kernel": "sm80"}' '{"kernel": "sm80", "comm_sms": 4}' \
      '{"kernel": "sm80", "comm_sms": 8}' '{"kernel": "sm80", "tile_n": 128}' \
      --output "$OUT/sm80/$REGISTRY" --csv "$OUT/sm80_tune.csv" > "$OUT/sm80_tune.log" 2>&1
    tail -4 "$OUT/sm80_tune.log"
    bench sm80_pcie FLASHOVERLAP_CONFIG_DIRS="$OUT/sm80" -- --transport pcie --shapes 8192x4096x14336 \
      --rounds "${ROUNDS:-15}" --configs '{}' registry '{"kernel": "sm80"}' '{"kernel": "sm80", "comm_sms": 4}' \
      '{"kernel": "sm80", "comm_sms": 8}' \
      --csv "$OUT/sm80_pcie.csv" ;;
  swizzle)
    for collective in ${COLLECTIVES:-all_reduce reduce_scatter all_to_all}; do
      case $collective in all_reduce) shapes="4096x8192x8192 8192x8192x8192";; reduce_scatter) shapes=16384x8192x4096;;
        all_to_all) shapes=8192x4096x7168;; esac
      bench "swizzle_$collective" -- --collective "$collective" --shapes $shapes --rounds "${ROUNDS:-15}" \
        --configs '{}' '{"swizzle": 2}' '{"swizzle": 4}' '{"swizzle": 8}' --csv "$OUT/swizzle_$collective.csv"
    done ;;
  tune)
    mkdir -p "$OUT/tuned"
    [ -f "$OUT/tuned/$REGISTRY" ] || [ ! -f "flashoverlap/configs/$REGISTRY" ] || cp "flashoverlap/configs/$REGISTRY" "$OUT/tuned/$REGISTRY"
    for collective in ${TUNE_COLLECTIVES:-all_reduce}; do
      for transport in ${TRANSPORTS:-nvlink pcie}; do
        name=tune_$transport; [ "$collective" = all_reduce ] || name=tune_${collective}_$transport
        timeout 420 torchrun --nproc-per-node "$NGPU" -m flashoverlap.tune --collective "$collective" \
          --transport "$transport" --shapes-file bench/suite.yaml --output "$OUT/tuned/$REGISTRY" \
          --csv "$OUT/$name.csv" ${TUNE_ARGS:-} > "$OUT/$name.log" 2>&1
        tail -12 "$OUT/$name.log"
      done
    done ;;
  brute)
    timeout 420 torchrun --nproc-per-node "$NGPU" -m flashoverlap.tune --collective all_reduce --transport nvlink \
      --shapes 4096x8192x8192 8192x4096x14336 --brute-force 4 --output "$OUT/brute.yaml" --csv "$OUT/brute.csv" \
      > "$OUT/brute.log" 2>&1
    tail -6 "$OUT/brute.log" ;;
  suite)
    for collective in ${SUITE_COLLECTIVES:-all_reduce}; do
      for transport in ${TRANSPORTS:-nvlink pcie}; do
        name=suite_$transport; [ "$collective" = all_reduce ] || name=suite_${collective}_$transport
        bench "$name" FLASHOVERLAP_CONFIG_DIRS="$OUT/tuned" -- --transport "$transport" --collective "$collective" \
          --shapes-file bench/suite.yaml --rounds "${ROUNDS:-15}" --configs registry '{}' --inputs "${INPUTS:-rotated}" \
          --csv "$OUT/$name.csv"
      done
    done ;;
  graphs)
    # each variant's block of calls replayed as one CUDA graph (GPU time only): the overlap itself,
    # without the host time an eager call spends (0.3-0.4 ms + ~0.1 ms per group through c10d on
    # the H200 host), as in a model captured in CUDA graphs; SUITE_COLLECTIVES, TRANSPORTS, CONFIGS, INPUTS
    for collective in ${SUITE_COLLECTIVES:-all_reduce}; do
      for transport in ${TRANSPORTS:-nvlink pcie}; do
        name=graphs_${collective}_$transport
        BENCH_TIMEOUT=300 bench "$name" -- --graphs --transport "$transport" --collective "$collective" \
          --shapes-file bench/suite.yaml --rounds "${ROUNDS:-15}" --configs registry ${CONFIGS:-'{}'} --inputs "${INPUTS:-rotated}" \
          --nccl c10d direct --csv "$OUT/$name.csv"
      done
    done ;;
  small)
    for collective in ${SMALL_COLLECTIVES:-all_reduce reduce_scatter all_to_all}; do
      for mode in ${SMALL_MODES:-eager graphs}; do
        name=small_${collective}_$mode
        graphs=(); [ "$mode" = graphs ] && graphs=(--graphs)
        # (more rounds than elsewhere, of up to 64 calls, the bench's default: a call of 0.05-0.5 ms
        # is mostly host time, which drifts; one decomposition, which these shapes do not need)
        BENCH_TIMEOUT=300 bench "$name" -- "${graphs[@]}" --collective "$collective" --shapes-file bench/small.yaml \
          --rounds "${ROUNDS:-20}" ${BLOCK:+--block "$BLOCK"} --chunks 2 --configs registry --inputs both \
          --csv "$OUT/$name.csv" --rounds-csv "$OUT/${name}_rounds.csv"
      done
    done ;;
  host)
    timeout 120 torchrun --nproc-per-node "$NGPU" bench/host_profile.py > "$OUT/host.log" 2>&1
    grep "us per call" "$OUT/host.log"
    timeout 120 torchrun --nproc-per-node "$NGPU" bench/replay_profile.py 1024x8192x2048 \
      '{"reduction": "pull_fused", "comm_sms": 0, "layout": "rows"}' reduce_scatter > "$OUT/replay.log" 2>&1
    grep -A24 "operations per call" "$OUT/replay.log" ;;
  fp8)
    CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/fp8_probe.py > "$OUT/fp8_probe.log" 2>&1
    grep -v '^\[flashoverlap\]' "$OUT/fp8_probe.log" | tail -n 40
    for accum in promoted fast; do
      fast=(); [ "$accum" = fast ] && fast=(--fast-accum)
      for transport in ${TRANSPORTS:-nvlink pcie}; do
        bench "fp8_${accum}_$transport" -- --dtype float8_e4m3fn "${fast[@]}" --transport "$transport" \
          --shapes-file bench/suite.yaml --rounds "${ROUNDS:-10}" --configs registry --csv "$OUT/fp8_${accum}_$transport.csv"
      done
    done
    bench fp8_rs_nvlink -- --dtype float8_e4m3fn --collective reduce_scatter --rounds "${ROUNDS:-10}" --configs registry \
      --shapes 4096x8192x2048 4096x8192x4096 8192x8192x4096 8192x8192x8192 16384x8192x4096 8192x8192x14336 \
      --csv "$OUT/fp8_rs_nvlink.csv" ;;
  symm)
    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING timeout 300 torchrun --nproc-per-node "$NGPU" \
      bench/symmetric_probe.py > "$OUT/symm.log" 2>&1
    grep -E "of cublas|Error|error" "$OUT/symm.log" | head -60; grep -m 8 -E "Symmetric|CE" "$OUT/symm.log" ;;
  *) echo "unknown step $step (tests stress bench sm80 swizzle tune brute suite graphs small host symm)"; exit 2 ;;
  esac
done
