#!/usr/bin/env bash
# One call on the GPU machine: the GPU tests, the main job at DeepSeek-V3 shapes, the kernel benchmarks.
#   [GPU_TESTS=tests/modes/intranode/test_gpu.py] scripts/gpu_check.sh [bench_kernels options, e.g. --sweep]
#   (outputs under $OUT, or ./out)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
./run.sh python -m pytest -m gpu -n 4 --dist loadgroup -q -rs -p no:cacheprovider ${GPU_TESTS:-} 2>&1 | tee "$out/gpu_tests.log" | tail -15
./run.sh python examples/moe_layer.py 2>&1 | tee "$out/moe_layer.log" | tail -4
if [ -f benchmarks/bench_kernels.py ]; then
    ./run.sh python benchmarks/bench_kernels.py --out "$out/bench" "$@" 2>&1 | tee "$out/bench.log" | tail -40
fi
