#!/usr/bin/env bash
# Run reproductions/reproduce_linreg.py as K single-threaded shards in parallel,
# wait for all of them, then merge the shard CSVs and redraw (--report).
# First, min(K, 10) processes compile the ten NUTS configurations into JAX's
# persistent cache ($JAX_COMPILATION_CACHE_DIR, default /tmp/linreg_jax_cache),
# so that each shard loads them instead of compiling all ten itself.
#
#   bash reproductions/run_linreg_sharded.sh 16                      # full size, 16 cores
#   bash reproductions/run_linreg_sharded.sh 2 --quick --runs 1 --dims 2 --out /tmp/t
#
# Extra arguments go to every shard and to --report.  PYTHON picks the
# interpreter (default: python); logs go to $LOG_DIR (default:
# <results folder>/shard_logs, i.e. docs/results/shard_logs unless --out).
# Restartable: a shard skips the rows already in the merged or any shard CSV.
set -euo pipefail

if [[ $# -lt 1 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 K [reproduce_linreg.py options]" >&2
    exit 2
fi
K=$1
shift
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}

out=docs/results
args=("$@")
for ((a = 0; a < ${#args[@]}; a++)); do
    case ${args[a]} in
        --out) out=${args[a + 1]} ;;
        --out=*) out=${args[a]#--out=} ;;
    esac
done
LOG_DIR=${LOG_DIR:-$out/shard_logs}
mkdir -p "$LOG_DIR"

# one core per shard
export JAX_PLATFORMS=cpu
export XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-${TMPDIR:-/tmp}/linreg_jax_cache}

start=$SECONDS
P=$((K < 10 ? K : 10))
pids=()
for ((i = 0; i < P; i++)); do
    "$PYTHON" reproductions/reproduce_linreg.py --compile-only --shard "$i/$P" "$@" \
        >"$LOG_DIR/compile$i.log" 2>&1 &
    pids+=($!)
done
for ((i = 0; i < P; i++)); do
    # a failed compile is not fatal: the shards compile what is missing
    wait "${pids[i]}" || echo "compile $i/$P failed: see $LOG_DIR/compile$i.log" >&2
done
echo "compiled in $((SECONDS - start)) s"

pids=()
for ((i = 0; i < K; i++)); do
    "$PYTHON" reproductions/reproduce_linreg.py --shard "$i/$K" "$@" >"$LOG_DIR/shard$i.log" 2>&1 &
    pids+=($!)
done
echo "started $K shards (logs in $LOG_DIR)"

failed=0
for ((i = 0; i < K; i++)); do
    if ! wait "${pids[i]}"; then
        echo "shard $i/$K failed: see $LOG_DIR/shard$i.log" >&2
        failed=1
    fi
done
echo "shards finished: $((SECONDS - start)) s since the start (compile step included)"

"$PYTHON" reproductions/reproduce_linreg.py --report "$@"
exit $failed
