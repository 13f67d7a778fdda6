#!/usr/bin/env bash
# One call on a GPU machine: host cost (benchmarks/host_cost.py) of a baseline copy and of this checkout,
# alternately, at T 128 and 4096, twice; then bench_calls --compare deep_ep with 2 ranks sharing the GPU.
#   git archive BASE_COMMIT | (mkdir -p .base && tar x -C .base)   # the baseline, git-ignored locally
#   cp benchmarks/host_cost.py .base/benchmarks/                    # both measured by the same script
#   [NO_CMP=1] scripts/gpu_compare.sh     # DeepEP: .peers/build_deepep.sh (the peer's build script) unless NO_CMP
# Outputs under $OUT (or ./out): hc_{base,new}_{128,4096}_1.json, calls_compare.json/.png, logs.tgz (every run).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-out}; w=$(mktemp -d); mkdir -p "$out"
./run.sh python -c "import torch; print(torch.__version__)" > "$w/venv.log" 2>&1
[ -z "${NO_CMP:-}" ] && { bash .peers/build_deepep.sh /tmp/dep > "$w/deepep_build.log" 2>&1; echo "deepep build rc=$? $(tail -1 "$w/deepep_build.log")"; }
for t in 128 4096; do
  for r in 1 2; do
    for v in base new; do
      if [ $v = base ]; then s=.base/benchmarks/host_cost.py; else s=benchmarks/host_cost.py; fi
      ./run.sh python $s --tokens $t --iters 40 --out "$w/hc_${v}_${t}_$r" > "$w/hc_${v}_${t}_$r.log" 2>&1
      echo "$v T=$t r=$r: $(grep -E '^(layout|cached|combine|worst|ll_|floor)' "$w/hc_${v}_${t}_$r.log" | awk '{print $1, $2, $4, $5}' | tr '\n' ';')"
    done
  done
done
[ -z "${NO_CMP:-}" ] && PYTHONPATH=/tmp/dep/deepep-567632d timeout ${CMP_S:-300} ./run.sh python benchmarks/bench_calls.py --ranks 2 --tokens 128,4096 \
    --buffers hint --compare deep_ep --out "$w/cmp" > "$w/cmp.log" 2>&1 && tail -14 "$w/cmp.log"
cp "$w"/cmp/calls_compare.* "$out"/ 2>/dev/null
for f in "$w"/hc_*_1/host_cost.json; do d=$(basename "$(dirname "$f")"); cp "$f" "$out/$d.json"; done
tar czf "$out/logs.tgz" -C "$w" .
