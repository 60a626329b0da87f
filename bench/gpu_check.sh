#!/usr/bin/env bash
# The GPU check in one call: the CUDA tests, then the sections of bench.gpu, each bounded, logs under $OUT.
#
# Prepared on a CPU machine (no GPU time spent there):
#   ../shared/tools/device-wheels            # .whl/: Ray, gguf, ... for the GPU image (add /.whl/ to .git/info/exclude)
#   .venv/bin/python -m bench.gpu --device cpu --small   # every section passes on the CPU
# Run on the GPU machine from the repository root, the wheels carried:
#   bash bench/gpu_check.sh            # whole run ends within ~8 minutes; STAGES="tests bench" picks stages
#
# Stages, in order (each in its own process, so a CUDA fault in one does not poison the next):
#   kernels  the Triton attention and fused-MoE kernels compiled, against the torch reference on CUDA tensors
#   tests    the Triton layer ops likewise; CUDA-graph capture and replay; the CUDA engine (fp32 tokens =
#            CPU's, the fast path = eager plain tokens, pipelined decode), the same-GPU hand-off
#   bench    peaks, decode at batch 1/8/64 eager / graphs / graphs+pipelined with GPU busy, prefill MFU
#            at 4096 tokens, transformers' decode step on the same shape
#   offline  pdserve LLMEngine against transformers generate(), greedy equality
#   cluster  the one-GPU 1P1D and colocated cluster on Ray, hand-off against prefill
# Then a short table of every stage's outcome, last.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
STAGES=${STAGES:-"kernels tests bench offline cluster"}
export PYTHONUNBUFFERED=1
start=$(date +%s)

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu \
    --format=csv 2>&1
  python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')" 2>&1
  python3 -c "import ray, gguf; print('ray', ray.__version__)" 2>&1
  nproc; uptime
} | tee "$OUT/env.txt"

summary=()
# stage NAME LOG LIMIT_S CMD...: runs CMD under a time limit, its output appended to $OUT/LOG (at most 8 files
# come back from a device call: the four test stages share tests.log), and one summary line.
stage() {
  local name=$1 log=$OUT/$2 limit=$3; shift 3
  local t0=$(date +%s) first=$(( $(cat "$OUT/$2" 2>/dev/null | wc -l) + 1 ))
  echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  local tail_line
  tail_line=$(tail -n +"$first" "$log" | grep -E "passed|failed|error|skipped" | tail -1)
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && tail_line="TIMED OUT after ${limit}s; $tail_line"
  summary+=("$(printf '%-16s rc=%-3s %4ss  %s' "$name" "$rc" "$dt" "${tail_line:0:150}")")
  echo "${summary[-1]}"
}
pytest_cmd=(python3 -m pytest -q -rfEs -p no:cacheprovider --timeout 120)

for s in $STAGES; do
  case $s in
    kernels)
      stage tests-attention tests.log 60 "${pytest_cmd[@]}" tests/kernels/test_triton_attention.py
      stage tests-moe tests.log 45 "${pytest_cmd[@]}" tests/kernels/test_triton_moe.py
      ;;
    tests)
      stage tests-layer-ops tests.log 45 "${pytest_cmd[@]}" tests/kernels/test_triton_layer_ops.py
      stage tests-graphs tests.log 60 "${pytest_cmd[@]}" tests/engine/test_cuda_graphs.py
      stage tests-cuda tests.log 80 "${pytest_cmd[@]}" tests/kernels/test_gpu.py
      ;;
    bench)
      stage bench bench.log 160 python3 -m bench.gpu --sections peaks,decode,prefill,hf_decode --json "$OUT/bench.json"
      ;;
    offline)
      stage offline offline.log 60 python3 -m bench.gpu --sections offline --json /tmp/gpu_offline.json
      ;;
    cluster)
      stage cluster cluster.log 80 python3 -m bench.gpu --sections cluster --json /tmp/gpu_cluster.json
      ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done

echo
echo "===== tables"
for f in bench offline cluster; do
  [ -f "$OUT/$f.log" ] && sed -n '/^=====*$/,$p' "$OUT/$f.log" | grep -v '^=====*$'
done
[ -f "$OUT/tests.log" ] && grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/tests.log" | cut -c1-220 | head -30
echo
echo "===== summary ($(( $(date +%s) - start )) s in all)"
printf '%s\n' "${summary[@]}"
