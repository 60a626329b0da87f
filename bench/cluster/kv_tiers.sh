#!/bin/bash
# KV tiers (#50 must-show 1): the same agentic workload without and then with a 1 GiB host tier, one after the
# other; docs/benchmarks.md ("KV tiers, second run") holds a run's figures. A timing run: alone on the machine.
set -e
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
COMMON="--sessions 12 --turns 16 --concurrency 12 --system-words 100 --tool-words 10 --max-tokens 24 --think 1 --think-max 5 --check"
SERVE="--prefill-workers 2 --decode-workers 2 --kv-cache-mib 64 --local-prefill-max-tokens 2048"
echo "== $(date -u) load: $(cut -d' ' -f1-3 /proc/loadavg)"
PYTHONPATH=. timeout -s INT 480 $PY -m bench.cluster.agentic $COMMON --label off --json /tmp/kvtier-off.json --serve-args "$SERVE"
echo "== $(date -u) load: $(cut -d' ' -f1-3 /proc/loadavg)"
PYTHONPATH=. timeout -s INT 480 $PY -m bench.cluster.agentic $COMMON --label on --json /tmp/kvtier-on.json --serve-args "$SERVE --kv-offload-mib 1024"
echo "== $(date -u) load: $(cut -d' ' -f1-3 /proc/loadavg)"
