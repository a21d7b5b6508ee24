#!/usr/bin/env bash
# Several nodes on GPUs (issue 19), from the bundle this script describes:
# two launchers as two nodes of one job on a machine with two GPUs, one GPU
# each (CUDA_VISIBLE_DEVICES), NCCL forced onto its network transport
# (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1). Runs the comm suite and
# data_parallel that way, times all-reduce (busbw) beside NVIDIA's
# nccl-tests (all_reduce_perf, built here from the source in the bundle,
# one process driving both GPUs: it has no MPI here), and runs the
# rendezvous bench beside PyTorch's TCPStore.
#
# With one GPU, both nodes share it: NCCL cannot put one GPU twice in a
# communicator, so the suite and data_parallel run with COHORT_DISABLE_NCCL=1
# (cohort's host path: TCP between the nodes, the GPU's buffers staged), and
# neither the NCCL timing nor nccl-tests runs.
#
# Bundle (on the build machine): bin/cohort, bin/cohort-comm-suite,
# examples/data_parallel, examples/rendezvous_bench,
# scripts/anchors/tcpstore_bench.py and nccl-tests/ (its source).
#   cd <bundle> && OUT=/some/dir ./nodes.sh      (log: $OUT/nodes.log)
set -u
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
L=$OUT/nodes.log
failed=0
step() { echo "== $*" | tee -a "$L"; }

gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "== $gpus GPU(s)" | tee -a "$L"
# nccl-tests' all_reduce_perf, built in the background (NCCL's header from
# wherever the machine has it, its library from the system).
build=none
if [ "$gpus" -ge 2 ]; then
    (
        inc=$(dirname "$(find / -xdev -name nccl.h -path '*include*' 2>/dev/null | head -1)")
        mkdir -p /tmp/ncclhome/lib
        ln -sfn "$inc" /tmp/ncclhome/include
        ln -sf /usr/lib/x86_64-linux-gnu/libnccl.so.2 /tmp/ncclhome/lib/libnccl.so
        make -C nccl-tests/src build BIN_FILES_LIST=all_reduce CUDA_HOME=/usr/local/cuda NCCL_HOME=/tmp/ncclhome \
            NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" -j 16
    ) >"$OUT/nccl-tests-build.log" 2>&1 &
    build=$!
fi

step rendezvous: cohort store, then TCPStore "(libuv)", same key pattern
timeout 150 examples/rendezvous_bench --tcpstore "python3 scripts/anchors/tcpstore_bench.py --serve" \
    1024 4096 16384 2>&1 | grep -v Warning | tee -a "$L"

export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
# Runs "$@" as the program of a two-node job: node n on GPU n (GPU 0 for
# both with one GPU).
nodes() {
    local name=$1 port=$((29000 + RANDOM % 2000))
    shift
    step "$name"
    for n in 0 1; do
        CUDA_VISIBLE_DEVICES=$((gpus >= 2 ? n : 0)) COHORT_JOB_SECRET=gpu-nodes-secret timeout 40 bin/cohort run -n 1 --nnodes 2 \
            --node-rank $n --master-addr 127.0.0.1 --master-port $port --timings -- "$@" >"$OUT/$name.node$n.log" 2>&1 &
    done
    local rc=0
    for job in $(jobs -p | grep -v "^$build$"); do wait "$job" || rc=$?; done
    tr '\r' '\n' <"$OUT/$name.node0.log" | grep -v "step " | tail -6 | tee -a "$L"
    grep -h "start-up" "$OUT/$name.node1.log" | tee -a "$L"
    if [ "$rc" -ne 0 ]; then
        echo "FAILED: $name (exit $rc)" | tee -a "$L"
        tail -5 "$OUT/$name.node1.log" | tee -a "$L"
        failed=$((failed + 1))
    fi
}
if [ "$gpus" -lt 2 ]; then
    export COHORT_DISABLE_NCCL=1
    nodes suite bin/cohort-comm-suite --backend cuda suite
    nodes data_parallel examples/data_parallel --backend cuda
    nodes all_reduce_16777216_host bin/cohort-comm-suite --backend cuda latency 16777216 20 all_reduce
    echo "== $failed step(s) failed (one GPU: no NCCL between the nodes, no nccl-tests)" | tee -a "$L"
    exit $((failed > 0))
fi
nodes suite bin/cohort-comm-suite --backend cuda suite
nodes data_parallel examples/data_parallel --backend cuda
for bytes in 16777216 268435456; do
    nodes "all_reduce_$bytes" bin/cohort-comm-suite --backend cuda latency $bytes 20 all_reduce
done

step nccl-tests all_reduce_perf, one process, 2 GPUs, same NCCL variables
if wait $build && [ -x nccl-tests/build/all_reduce_perf ]; then
    timeout 60 nccl-tests/build/all_reduce_perf -b 16M -e 256M -f 16 -g 2 -n 20 -w 5 2>&1 | tee -a "$L"
else
    echo "FAILED: nccl-tests did not build:" | tee -a "$L"
    tail -8 "$OUT/nccl-tests-build.log" | tee -a "$L"
    failed=$((failed + 1))
fi
echo "== $failed step(s) failed" | tee -a "$L"
[ "$failed" -eq 0 ]
