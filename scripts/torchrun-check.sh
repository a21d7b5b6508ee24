#!/usr/bin/env bash
# Issue 15's proof: stock torch.distributed programs under `cohort run`,
# each beside the same program under torchrun, with the start-up times of
# both. scripts/gpu-bundle.sh copies this file and scripts/anchors/ into the
# bundle:
#
#   cd gpu-bundle && OUT=/some/dir ./torchrun-check.sh      # log: $OUT/torchrun-check.log
#   scripts/torchrun-check.sh                               # from a checkout (target/release/cohort)
#   REPEAT=5 GLOO_N=4 ./torchrun-check.sh                   # more runs; ranks of the gloo program
#
# Runs, each under both launchers, alternating, REPEAT times (default 3):
#   env_check.py        (no torch needed) torchrun's variables, MASTER_PORT free for rank 0
#   torch_gloo.py       -n $GLOO_N (4): init_process_group("gloo"), all_reduce, all_gather, barrier
#   torch_ddp_nccl.py   -n gpu (torchrun: --nproc_per_node gpu): DDP on NCCL, replicas checked identical (needs CUDA)
# then torch_gloo.py with FAIL_RANK=1 under cohort: the summary must name
# rank 1 and its Python error. Prints per program and launcher the median
# wall time of the whole run (launcher start to exit) and of the program's
# own `startup_s` (process start to its first all-reduce done), and exits 1
# when any run failed.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ -n "${COHORT:-}" ]; then :
elif [ -x "$here/bin/cohort" ]; then COHORT=$here/bin/cohort
elif [ -x "$here/../target/release/cohort" ]; then COHORT=$here/../target/release/cohort
else echo "no cohort binary: build it (cargo build --release -p cohort-launch) or set COHORT" >&2; exit 1; fi
if [ -d "$here/scripts/anchors" ]; then anchors=$here/scripts/anchors; else anchors=$here/anchors; fi
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
log=$OUT/torchrun-check.log
: >"$log"
REPEAT=${REPEAT:-3}
GLOO_N=${GLOO_N:-4}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
say() { echo "$*" | tee -a "$log"; }

if python3 -c 'import torch' 2>/dev/null; then have_torch=1; else have_torch=0; fi
if command -v torchrun >/dev/null; then torchrun=(torchrun); else torchrun=(python3 -m torch.distributed.run); fi
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
say "== machine: $(hostname), python3 $(python3 -c 'import sys; print(sys.version.split()[0])'), torch $(python3 -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null || echo none), GPUs $gpus"
say "== cohort: $COHORT"

failures=0
results=()
# run LAUNCHER NPROC SCRIPT [ARGS]: one run; appends "launcher script wall startup rc".
run() {
    local launcher=$1 n=$2 script=$3; shift 3
    local port start end rc out
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    out=$(mktemp)
    start=$(date +%s.%N)
    if [ "$launcher" = cohort ]; then
        timeout 300 "$COHORT" run -n "$n" --master-port "$port" -- "$anchors/$script" "$@" >"$out" 2>&1
    else
        timeout 300 "${torchrun[@]}" --nproc_per_node "$n" --master_port "$port" "$anchors/$script" "$@" >"$out" 2>&1
    fi
    rc=$?
    end=$(date +%s.%N)
    cat "$out" >>"$log"
    local wall startup
    wall=$(python3 -c "print(f'{$end - $start:.3f}')")
    startup=$(grep -ao 'startup_s [0-9.]*' "$out" | head -1 | cut -d' ' -f2)
    rm -f "$out"
    [ "$rc" -ne 0 ] && failures=$((failures + 1))
    say "  $launcher $script -n $n: rc=$rc wall_s=$wall startup_s=${startup:--}"
    results+=("$launcher $script $wall ${startup:--} $rc")
}

pair() {
    local n=$1; shift
    for i in $(seq "$REPEAT"); do
        say "== $* (run $i of $REPEAT)"
        if [ $((i % 2)) -eq 1 ]; then run cohort "$n" "$@"; run torchrun "$n" "$@"
        else run torchrun "$n" "$@"; run cohort "$n" "$@"; fi
    done
}

if [ "$have_torch" = 1 ]; then
    pair "$GLOO_N" env_check.py
    pair "$GLOO_N" torch_gloo.py
    if [ "$gpus" -gt 0 ] && python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        pair gpu torch_ddp_nccl.py 50   # -n gpu and --nproc_per_node gpu: one rank per GPU
    else
        say "== no CUDA GPU for torch: torch_ddp_nccl.py skipped"
    fi
    say "== a failing PyTorch rank under cohort (FAIL_RANK=1)"
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    out=$(FAIL_RANK=1 timeout 120 "$COHORT" run -n "$GLOO_N" --master-port "$port" -- "$anchors/torch_gloo.py" 2>&1)
    rc=$?
    echo "$out" >>"$log"
    if [ "$rc" -ne 0 ] && grep -q 'rank 1 failed first' <<<"$out" && grep -q 'RuntimeError: rank 1 failing on purpose' <<<"$out"; then
        say "  ok: exit $rc, the summary names rank 1 and its last lines"
    else
        say "  FAILED: exit $rc; summary:"; grep -a '^cohort' <<<"$out" | tee -a "$log"
        failures=$((failures + 1))
    fi
else
    say "== torch is not installed here: only env_check.py under cohort (pip install torch for the rest)"
    for i in $(seq "$REPEAT"); do run cohort "$GLOO_N" env_check.py; done
fi

say "== summary: median seconds over $REPEAT runs (wall: launcher start to exit; startup: process start to first all-reduce)"
printf '%s\n' "${results[@]}" | python3 -c '
import sys, statistics
rows = {}
for line in sys.stdin:
    if not line.strip():
        continue
    launcher, script, wall, startup, rc = line.split()
    r = rows.setdefault((script, launcher), {"wall": [], "startup": [], "fail": 0})
    r["wall"].append(float(wall))
    if startup != "-":
        r["startup"].append(float(startup))
    r["fail"] += rc != "0"
print("%-20s %-9s %8s %10s %6s" % ("program", "launcher", "wall_s", "startup_s", "failed"))
for (script, launcher), r in sorted(rows.items()):
    st = "%.3f" % statistics.median(r["startup"]) if r["startup"] else "-"
    print("%-20s %-9s %8.3f %10s %6d" % (script, launcher, statistics.median(r["wall"]), st, r["fail"]))
' | tee -a "$log"
say "== failures: $failures"
[ "$failures" -eq 0 ]
