#!/usr/bin/env bash
# Router CPU per request: `pdserve serve` on simulated workers (1P2D of an H100 running Llama-3-8B,
# --stream-interval 16; more serve flags pass through), a 200-request warm-up, then 2,000 closed-loop
# requests of 128 prompt tokens and 2 output tokens at concurrency 32, so that the per-request work
# dominates; the CPU seconds of the serve process (the router and its doors) are read from /proc around
# that run. Run from the project root after `make setup`:
#   bench/router/router_request_cpu.sh [serve flags...]        (PD=path/to/pdserve, PORT=... to override)
set -euo pipefail
PD=${PD:-.venv/bin/pdserve}; port=${PORT:-50093}
log=$(mktemp)
$PD serve --host 127.0.0.1 --port "$port" --metrics-port 0 --http-port 0 --load-format sim --model llama3-8b \
  --dtype bfloat16 --prefill-workers 1 --decode-workers 2 --stream-interval 16 "$@" >"$log" 2>&1 &
pid=$!; trap 'kill -INT $pid 2>/dev/null; sleep 5; kill -KILL $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do $PD status --target "127.0.0.1:$port" >/dev/null 2>&1 && break
  kill -0 $pid 2>/dev/null || { tail -5 "$log"; exit 1; }; sleep 1; done
cpu() { awk '{print $14+$15}' "/proc/$pid/stat"; }
bench() {
  $PD bench --target "127.0.0.1:$port" --arrival closed --concurrency 32 --num-prompts "$1" --input-len 128 \
    --output-len 2 --lengths fixed --ignore-eos --no-progress --output "$2" >/dev/null 2>&1
}
bench 200 "$log.warm.json"
c0=$(cpu); t0=$(date +%s.%N)
bench 2000 "$log.json"
c1=$(cpu); t1=$(date +%s.%N)
python3 - "$log.json" "$c0" "$c1" "$t0" "$t1" "$(getconf CLK_TCK)" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
c0, c1, t0, t1, tck = map(float, sys.argv[2:])
cpu = (c1 - c0) / tck
print(f"{r['completed']} requests in {t1 - t0:.1f} s ({r['completed'] / (t1 - t0):.0f}/s): router "
      f"{1e3 * cpu / r['completed']:.2f} ms CPU a request; failed {r['failed']}")
PY
