#!/usr/bin/env bash
# The multi-GPU runs on a machine with several GPUs, from the bundle
# scripts/gpu-bundle.sh makes (it copies this file in as multi.sh):
#   cd gpu-bundle && OUT=/some/dir ./multi.sh [tests|runs|bench|goals|all]   (log: $OUT/multi.log)
# `tests` runs the bundled GPU tests (each one's full output in $OUT/<test>.log); `runs` `cohort peers`, the comm suite
# with one process per GPU and data_parallel both ways; `bench` the five
# collectives beside raw NCCL (nccl_bench) and torch.distributed; `goals`
# the benchmarks whose goals need several GPUs: split against a fresh
# communicator (split_bench), grouped against separate calls
# (grouped_bench), DDP beside PyTorch DDP with scaling and the hidden share
# (ddp_bench), the peer-memory paths and graph replay against raw NCCL
# (nccl_bench --algo, --step; rank_bench --algo, one process per GPU). Each part fits in one 10-minute device call;
# `goals` needs the bundle's examples split_bench, grouped_bench, ddp_bench,
# nccl_bench and rank_bench, and torch for ddp_bench's anchor. Every GPU of the machine takes part;
# NCCL_NVLS_ENABLE stays 0. Exits 1 when any test binary or step failed.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")"
what=${1:-all}
mkdir -p /tmp/ncclfix; ln -sf /usr/lib/x86_64-linux-gnu/libnccl.so.2 /tmp/ncclfix/libnccl.so
export LD_LIBRARY_PATH=/tmp/ncclfix${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
L=$OUT/multi.log
gpus=$(nvidia-smi -L | wc -l)
# Every step's exit status counts: the script exits 1 when any failed.
failed=0
step() { echo "== $*" | tee -a $L; }
# Counts a step as failed when its command (the first of its pipe:
# "${PIPESTATUS[0]}") exited non-zero.
check() {
    local rc=$1 what=$2
    if [ "$rc" -ne 0 ]; then
        echo "FAILED: $what exited with $rc" | tee -a $L
        failed=$((failed + 1))
    fi
}
nvidia-smi -L | tee -a $L; nvidia-smi topo -m 2>&1 | head -$((gpus + 1)) | tee -a $L
if [ "$what" = tests ] || [ "$what" = all ]; then
    skip=""; [ "$gpus" -lt 4 ] && skip="--skip four_gpus_"
    step tests
    for t in tests/*; do
        # shellcheck disable=SC2086
        timeout 300 $t --include-ignored --test-threads=1 $skip >"$OUT/$(basename "$t").log" 2>&1
        rc=$?
        grep -E "^test |test result|panicked" "$OUT/$(basename "$t").log" | tee -a $L
        if [ "$rc" -ne 0 ]; then
            echo "FAILED: $(basename "$t") exited with $rc (full output: $OUT/$(basename "$t").log)" | tee -a $L
            failed=$((failed + 1))
        fi
    done
fi
if [ "$what" = runs ] || [ "$what" = all ]; then
    step peers; timeout 60 bin/cohort peers --backend cuda --mib 256 --iters 5 2>&1 | tee -a $L
    check "${PIPESTATUS[0]}" "peers"
    step communicator; timeout 60 bin/cohort run -n gpu --master-port 0 -- bin/cohort-comm-suite --backend cuda 2>&1 | tail -3 | tee -a $L
    check "${PIPESTATUS[0]}" "communicator"
    step communicator full matrix to 1 GiB; timeout 240 bin/cohort run -n gpu --master-port 0 -- bin/cohort-comm-suite --backend cuda full 2>&1 | tail -3 | tee -a $L
    check "${PIPESTATUS[0]}" "communicator full matrix to 1 GiB"
    step data_parallel one process; timeout 60 examples/data_parallel --backend cuda 2>&1 | tr '\r' '\n' | grep -v "step " | tail -5 | tee -a $L
    check "${PIPESTATUS[0]}" "data_parallel one process"
    step data_parallel one process per GPU; timeout 60 bin/cohort run -n gpu --master-port 0 -- examples/data_parallel --backend cuda 2>&1 | tr '\r' '\n' | grep -v "step " | tail -6 | tee -a $L
    check "${PIPESTATUS[0]}" "data_parallel one process per GPU"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    step nccl_bench; timeout 200 examples/nccl_bench --collective all -b 8 -e 4G -f 8 -n 20 -w 5 -t 3 --check-max 128M 2>&1 | tee -a $L
    check "${PIPESTATUS[0]}" "nccl_bench"
    step nccl_bench from 64 MiB; timeout 300 examples/nccl_bench --collective all -b 64M -e 4G -f 2 -n 40 -w 5 -t 3 -c 0 2>&1 | tee -a $L
    check "${PIPESTATUS[0]}" "nccl_bench from 64 MiB"
    step latency; timeout 100 examples/nccl_bench --collective all -b 8 -e 64K -f 8 -n 2000 -w 200 -t 5 2>&1 | tee -a $L
    check "${PIPESTATUS[0]}" "latency"
    step torch; timeout 200 torchrun --nproc_per_node $gpus scripts/anchors/torch_collectives.py 8 4294967296 8 2>&1 | grep -v Warning | tee -a $L
    check "${PIPESTATUS[0]}" "torch"
fi
if [ "$what" = goals ] || [ "$what" = all ]; then
    step split against a fresh communicator, one process per GPU
    timeout 120 bin/cohort run -n gpu --master-port 0 -- examples/split_bench 5 cuda 2>&1 | tee -a $L
    check "${PIPESTATUS[0]}" "split_bench"
    step grouped against separate, one process per GPU
    timeout 120 bin/cohort run -n gpu --master-port 0 -- examples/grouped_bench 20 cuda 2>&1 | tee -a $L
    check "${PIPESTATUS[0]}" "grouped_bench"
    step peer-memory paths against raw NCCL, one process over every GPU
    timeout 240 examples/nccl_bench --algo all --write-crossover -b 8 -e 256M -f 4 -n 200 -w 20 -t 3 -c 0 2>&1 | tee -a $L
    check "${PIPESTATUS[0]}" "nccl_bench --algo all"
    step every path against raw NCCL, one process per GPU
    for algo in nccl oneshot twoshot; do
        timeout 150 bin/cohort run -n gpu --master-port 0 -- examples/rank_bench --algo $algo --collective all_reduce \
            -b 8 -e 16M -f 8 -n 500 -w 50 -t 3 2>&1 | tee -a $L
        check "${PIPESTATUS[0]}" "rank_bench --algo $algo"
    done
    timeout 200 bin/cohort run -n gpu --master-port 0 -- examples/rank_bench --collective all -b 8 -e 1G -f 16 --plot "$OUT/rank.svg" \
        -n 20 -w 5 -t 3 2>&1 | tee -a $L
    check "${PIPESTATUS[0]}" "rank_bench --collective all"
    step small all-reduces on a group split from the world by ncclCommSplit, one process per GPU
    timeout 120 bin/cohort run -n gpu --master-port 0 -- examples/rank_bench --split --algo nccl --collective all_reduce \
        -b 8 -e 1M -f 8 -n 500 -w 50 -t 3 2>&1 | tee -a $L
    check "${PIPESTATUS[0]}" "rank_bench --split"
    step a step of ten small all-reduces, eager against graph replay
    timeout 120 examples/nccl_bench --step --algo all -n 500 -w 50 2>&1 | tee -a $L
    check "${PIPESTATUS[0]}" "nccl_bench --step"
    step DDP beside PyTorch DDP, the large model, every GPU count
    timeout 400 examples/ddp_bench --backend cuda --large --priorities both --split off,last \
        --plot "$OUT/ddp.svg" --timeline "$OUT/ddp-step.json" 2>&1 | tee -a $L
    check "${PIPESTATUS[0]}" "ddp_bench"
fi
if [ "$failed" -ne 0 ]; then
    echo "== $failed step(s) failed" | tee -a $L
    exit 1
fi
echo "== every step passed" | tee -a $L
