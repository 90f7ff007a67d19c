# Sourced by the GPU scripts: environment, carried wheels, kernel cache, prebuilt instances.
OUT=${OUT:-/tmp/flashoverlap-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHOVERLAP_CACHE_DIR=${FLASHOVERLAP_CACHE_DIR:-$PWD/.kcache}
if compgen -G ".whl/*.whl" >/dev/null; then
  # a fresh target each time: sourcing this a second time on one machine once left cutlass_library
  # unimportable
  rm -rf /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
  python3 -c 'import cutlass_library' || { echo "cutlass_library not importable from /tmp/site" >&2; exit 1; }
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
# the registry file of this machine, as flashoverlap/configs/ names them (h200_x2.yaml, h100_x2.yaml, rtx4090_x2.yaml)
REGISTRY=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z' 'a-z' |
  grep -o 'rtx [0-9]*\|[ahl][0-9]\+' | head -1 | tr -d ' ')
REGISTRY=${REGISTRY:-gpu}_x$NGPU.yaml
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; nvidia-smi topo -m; nvcc --version | tail -1;
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'; } > "$OUT/env.txt" 2>&1
head -3 "$OUT/env.txt"
timeout 300 python3 -m flashoverlap.precompile --jobs 14 --file bench/kernels.yaml --registry --skip-unsupported \
  > /tmp/flashoverlap-build.log 2>&1 || { tail -30 /tmp/flashoverlap-build.log; exit 1; }

# bench NAME [env assignments...] -- [flashoverlap.bench args...]: one torchrun (BENCH_TIMEOUT s, default
# 180), logged to $OUT/NAME.log
bench() {
  local name=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout "${BENCH_TIMEOUT:-180}" torchrun --nproc-per-node "$NGPU" -m flashoverlap.bench "$@" > "$OUT/$name.log" 2>&1
  echo "== $name ${envs[*]}"; grep -v '^\[flashoverlap\]' "$OUT/$name.log" | tail -n 25
}
