#!/usr/bin/env bash
# Builds the GPU test and bench executables here (where the Rust toolchain
# is) and bundles them into gpu-bundle/ with run.sh, which runs them on a GPU
# machine that has no toolchain:
#
#   scripts/gpu-bundle.sh            # build and bundle
#   cd gpu-bundle && ./run.sh        # on the GPU machine: tests, then benches
#   ./run.sh tests | ./run.sh bench  # one half only
#   TESTS='cuda_*' ./run.sh tests    # only some test binaries
#   BENCHES='cuda_runtime_bench nccl_bench' ./run.sh bench
#   BENCHES=ddp_bench BENCH_ARGS='--backend cuda --large' ./run.sh bench   # DDP beside torch DDP
#   LOG=second ./run.sh ...          # log to $OUT/second.log (several runs in one command)
#   ./torchrun-check.sh              # PyTorch DDP (NCCL) and gloo under cohort run and torchrun, start-up times
#
# BUNDLE_TESTS='cuda_* wgpu_conformance' scripts/gpu-bundle.sh bundles only
# the matching test binaries (BUNDLE_EXAMPLES likewise for examples) (each links every backend: the whole set can
# pass the 64 MiB a device call may carry).
#
# run.sh writes one log, $OUT/gpu-run.log (OUT defaults to ./out), and prints
# a summary last. Binaries are built without debug info and stripped to keep
# the bundle small.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
bundle=$root/gpu-bundle
export CARGO_PROFILE_RELEASE_DEBUG=0

rm -rf "$bundle"
mkdir -p "$bundle/tests" "$bundle/examples" "$bundle/scripts"

# Integration test executables of each package that builds (comm's when it
# has GPU tests too).
collect_tests() {
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"] and "test" in m["target"]["kind"]:
        print(m["executable"])
'
}
# Whether $1 matches one of the glob patterns in $2 (no filename expansion).
matches() {
    local name=$1 pattern
    set -f
    for pattern in $2; do
        # shellcheck disable=SC2254
        case "$name" in $pattern) set +f; return 0 ;; esac
    done
    set +f
    return 1
}

# cohort (the facade) holds the DDP tests (cuda_ddp: one GPU and two_gpus_).
# A package whose tests do not build stops the bundle: a bundle without them
# would run, and pass, fewer tests on the GPU machine.
for package in cohort-runtime cohort-comm cohort; do
    # comm's foreign-memory tests (cuda_foreign) need its GPU features on.
    features=""
    [ "$package" = cohort-comm ] && features="--features cuda,wgpu"
    # shellcheck disable=SC2086
    if ! cargo test --release --no-run --tests -p "$package" $features --message-format=json >"$bundle/.build-$package.json" 2>"$bundle/.build-$package.err"; then
        echo "error: the tests of $package did not build; no bundle made (cargo's output: gpu-bundle/.build-$package.err, its end below)" >&2
        tail -n 30 "$bundle/.build-$package.err" >&2
        exit 1
    fi
    collect_tests <"$bundle/.build-$package.json" | while read -r exe; do
        name=$(basename "$exe" | sed 's/-[0-9a-f]\{16\}$//')
        if matches "$name" "${BUNDLE_TESTS:-*}"; then
            # Two packages' tests of one name both go: the later one
            # takes its package's name as a suffix.
            [ -e "$bundle/tests/$name" ] && name="$name-$package"
            cp "$exe" "$bundle/tests/$name"
        fi
    done
    rm -f "$bundle/.build-$package.json"
done

cargo build --release --examples
for exe in "$root"/target/release/examples/*; do
    if [ ! -f "$exe" ] || [ ! -x "$exe" ]; then continue; fi
    case "$(basename "$exe")" in *-*|*.d) continue ;; esac
    matches "$(basename "$exe")" "${BUNDLE_EXAMPLES:-*}" || continue
    cp "$exe" "$bundle/examples/"
done
cp -r "$root/scripts/anchors" "$bundle/scripts/"
# The launcher and the cross-process suite, for multi.sh's Communicator runs.
cargo build --release -p cohort-launch --bins
mkdir -p "$bundle/bin"
cp "$root/target/release/cohort" "$root/target/release/cohort-comm-suite" "$bundle/bin/"
cp "$root/scripts/gpu-multi.sh" "$bundle/multi.sh"
# PyTorch under `cohort run` beside torchrun (issue 15): ./torchrun-check.sh
cp "$root/scripts/torchrun-check.sh" "$bundle/torchrun-check.sh"
strip "$bundle"/tests/* "$bundle"/examples/* "$bundle"/bin/* 2>/dev/null || true

cat >"$bundle/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the bundled GPU tests and benches; see scripts/gpu-bundle.sh.
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
log=$OUT/${LOG:-gpu-run}.log
: >"$log"
what=${1:-all}

# NVRTC: add the folder of libnvrtc.so.13 (CUDA toolkit or pip wheel) when
# the loader would not find it.
if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc.so'; then
    nvrtc=$(find /usr/local /usr/lib /opt -name 'libnvrtc.so*' 2>/dev/null | grep -v stub | head -1)
    [ -n "$nvrtc" ] && export LD_LIBRARY_PATH="$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# The NVRTC cache stays where cohort puts it by default (the user's own
# $XDG_CACHE_HOME or ~/.cache): a shared folder such as /tmp would let
# another local user plant compiled kernels.
{
    echo "== machine"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
} 2>&1 | tee -a "$log"

summary=()
# Exit status: 1 when any test binary, bench or anchor failed.
failed=0
# Tests named two_gpus_* / four_gpus_* need that many GPUs: skipped on fewer
# (reported as filtered out, not passed).
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
skip=""
[ "$gpus" -lt 2 ] && skip="--skip two_gpus_"
[ "$gpus" -lt 4 ] && skip="$skip --skip four_gpus_"
if [ "$what" = all ] || [ "$what" = tests ]; then
    for t in tests/${TESTS:-*}; do
        [ -x "$t" ] || continue
        echo "== test $(basename "$t")" | tee -a "$log"
        # shellcheck disable=SC2086
        timeout "${TEST_TIMEOUT:-300}" "$t" --include-ignored --test-threads="${TEST_THREADS:-1}" $skip ${TEST_FILTER:-} 2>&1 | tee -a "$log"
        rc=${PIPESTATUS[0]}
        [ "$rc" -ne 0 ] && failed=$((failed + 1))
        result=$(grep -a '^test result:' "$log" | tail -1)
        summary+=("$(basename "$t"): rc=$rc ${result#test result: }")
    done
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
    for name in ${BENCHES:-cuda_runtime_bench}; do
        b=examples/$name
        [ -x "$b" ] || continue
        echo "== bench $name ${BENCH_ARGS:-}" | tee -a "$log"
        # shellcheck disable=SC2086
        timeout 300 "$b" ${BENCH_ARGS:-} 2>&1 | tee -a "$log"
        rc=${PIPESTATUS[0]}
        [ "$rc" -ne 0 ] && failed=$((failed + 1))
        summary+=("$(basename "$b"): rc=$rc")
    done
    if command -v python3 >/dev/null; then
        echo "== anchor torch_runtime.py" | tee -a "$log"
        PYTHONUNBUFFERED=1 timeout 300 python3 scripts/anchors/torch_runtime.py 2>&1 | tee -a "$log"
        rc=${PIPESTATUS[0]}
        [ "$rc" -ne 0 ] && failed=$((failed + 1))
        summary+=("torch_runtime.py: rc=$rc")
    fi
fi
echo "== summary" | tee -a "$log"
printf '%s\n' "${summary[@]}" | tee -a "$log"
if [ "$failed" -ne 0 ]; then
    echo "== $failed failed" | tee -a "$log"
    exit 1
fi
RUN
chmod +x "$bundle/run.sh"
du -sh "$bundle"
ls -la "$bundle/tests" "$bundle/examples"
