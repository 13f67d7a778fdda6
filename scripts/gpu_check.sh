#!/usr/bin/env bash
# One call on the GPU machine: the GPU tests, the main job at DeepSeek-V3 shapes, the kernel benchmarks.
#   [GPU_TESTS=tests/modes/intranode/test_gpu.py] [SUITE_TIMEOUT_S=540] scripts/gpu_check.sh [bench_kernels options, e.g. --sweep]
#   (outputs under $OUT, or ./out)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
# bounded: each test by TRITON_EP_GPU_TEST_TIMEOUT_S (150 s), the whole run by SUITE_TIMEOUT_S (a hang is a failure)
timeout -s INT -k 15 "${SUITE_TIMEOUT_S:-540}" ./run.sh python -m pytest -m gpu -n 6 --dist loadgroup -v -rfEs \
    -p no:cacheprovider --durations=25 ${GPU_TESTS:-} > "$out/gpu_tests.log" 2>&1
echo "GPU tests: exit status $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/gpu_tests.log" | tail -15
./run.sh python examples/moe_layer.py 2>&1 | tee "$out/moe_layer.log" | tail -4
if [ -f benchmarks/bench_kernels.py ]; then
    ./run.sh python benchmarks/bench_kernels.py --out "$out/bench" "$@" 2>&1 | tee "$out/bench.log" | tail -40
fi
