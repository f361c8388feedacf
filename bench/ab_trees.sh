#!/usr/bin/env bash
# Paired before/after runs of the engine and fabric benchmarks between two source trees, alternating
# (before, after, before, after, ...) so that both see the same phases of a noisy host.
#
#   bash bench/ab_trees.sh BEFORE_TREE AFTER_TREE OUT_DIR [ROUNDS]
#
# Each tree must have its native extensions built in place (`python setup.py build_ext --inplace`)
# and is put first on PYTHONPATH (with its proto/ folder), so the one .venv serves both. The engine
# benchmark runs pdserve alone (bench/engine_throughput.py --systems pdserve, its default workload);
# the fabric benchmark is `python -m fabric.bench` in trees that still have it, else
# bench/fabric_transfer.py, over shm on huge pages. Outputs go to OUT_DIR/{engine,fabric}-{before,after}-N.*
set -euo pipefail
before=$(cd "$1" && pwd); after=$(cd "$2" && pwd); out=$3; rounds=${4:-2}
mkdir -p "$out"
py=$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python
run_tree() {  # tree tag n
  local tree=$1 tag=$2 n=$3
  export PYTHONPATH="$tree:$tree/proto"
  (cd "$tree" && "$py" bench/engine_throughput.py --systems pdserve --results-dir "$out" --tag "$tag-$n" \
     > "$out/engine-$tag-$n.log" 2>&1)
  if [ -f "$tree/fabric/bench.py" ]; then fab=(-m fabric.bench); else fab=(bench/fabric_transfer.py); fi
  (cd "$tree" && "$py" "${fab[@]}" --providers shm --pages huge > "$out/fabric-$tag-$n.log" 2>&1)
  unset PYTHONPATH
}
for n in $(seq 1 "$rounds"); do
  run_tree "$before" before "$n"
  run_tree "$after" after "$n"
done
echo "done: $out"
