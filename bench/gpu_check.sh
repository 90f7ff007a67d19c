#!/usr/bin/env bash
# One call on a GPU machine: install, build, GPU tests, and the side-by-side comparison.
#   bash bench/gpu_check.sh            (logs under $OUT, default /tmp/flashoverlap-check)
# Wheels the machine lacks (nvidia-cutlass) may sit in .whl/; a prebuilt kernel cache in .kcache/.
set -uo pipefail
OUT=${OUT:-/tmp/flashoverlap-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHOVERLAP_CACHE_DIR=${FLASHOVERLAP_CACHE_DIR:-$PWD/.kcache}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; nvidia-smi topo -m; nvcc --version | tail -1;
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'; } 2>&1 | tee "$OUT/env.txt"

SPECS="bfloat16:nk:128x256:1 bfloat16:nk:128x256:2 bfloat16:nk:256x128:1 bfloat16:nk:128x128:1 float16:nk:128x256:1 bfloat16:kn:128x256:1"
timeout 300 python3 bench/precompile.py --jobs 8 $SPECS 2>&1 | tee "$OUT/build.log" || exit 1

timeout 300 python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/test_gpu.log" | tail -5
timeout 300 python3 -m pytest -q -m multigpu tests/ 2>&1 | tee "$OUT/test_multigpu.log" | tail -5

SHAPES=${SHAPES:-"4096x8192x8192 8192x8192x8192"}
CONFIGS=${CONFIGS:-'{} {"comm_sms":0} {"comm_sms":16} {"comm_sms":32} {"cluster_m":2} {"tile_n":128} {"layout":"tiles"}'}
for transport in ${TRANSPORTS:-nvlink pcie}; do
  timeout 300 torchrun --nproc-per-node "$NGPU" -m flashoverlap.bench --transport "$transport" --shapes $SHAPES \
    --configs $CONFIGS --iters "${ITERS:-30}" --csv "$OUT/bench_${transport}.csv" 2>&1 | tee "$OUT/bench_${transport}.log" \
    | grep -v '^\[flashoverlap\]'
done
