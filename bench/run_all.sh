#!/usr/bin/env bash
# Run parcomp's benchmarks: tp_mlp (emitted TP forward program vs DTensor / hand-written /
# unsharded), tp_mlp_train (the same for one training step: fwd+bwd+SGD) and compile_time
# (import, compile_graph, emit_program). Other arguments go to every script,
# e.g. `bash bench/run_all.sh --quick` (smoke run, < 1 min) or `--plain` (no rich tables).
# `--json PREFIX` writes PREFIX.tp_mlp.json, PREFIX.tp_mlp_train.json and PREFIX.compile_time.json.
# PY selects the interpreter (default: the repo's .venv, else python3).
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
if [ -z "${PY:-}" ]; then
  if [ -x "$root/.venv/bin/python" ]; then PY="$root/.venv/bin/python"; else PY=python3; fi
fi
args=() json=""
while [ $# -gt 0 ]; do
  if [ "$1" = "--json" ] && [ $# -ge 2 ]; then json=$2; shift 2; else args+=("$1"); shift; fi
done
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null) (timings assume an otherwise idle machine)"
rc=0
for b in tp_mlp tp_mlp_train compile_time; do
  extra=()
  [ -n "$json" ] && extra=(--json "$json.$b.json")
  echo "=== $b ${args[*]:-}"
  timeout 400 "$PY" "$here/$b.py" ${args[@]+"${args[@]}"} ${extra[@]+"${extra[@]}"} || { r=$?; echo "!!! $b failed (rc=$r)"; rc=1; }
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"
exit $rc
