#!/usr/bin/env bash
# Installs what the tests need, then runs every check and test of the
# workspace. Used by .ci/run and by hand: `scripts/test.sh`. It ends, pass or
# fail, with the ignored and failed tests by name and one closing line,
# `N passed, N failed, N ignored`, that counts each distinct test once.
set -euo pipefail
cd "$(dirname "$0")/.."

# The step running now, named when the script stops on a failure.
step="set-up"
log() {
    step=$*
    # Each step also prints the free disk, so a run that fills it says where.
    printf '\n== %s (disk free: %s)\n' "$*" "$(df -h --output=avail . 2>/dev/null | tail -1 | tr -d ' ')"
}

# Every test step's output, stdout and stderr in the order written, also goes
# here: the closing totals are counted from it.
test_log=$(mktemp "${TMPDIR:-/tmp}/cohort-test-log.XXXXXX")
run_tests() {
    "$@" 2>&1 | tee -a "$test_log"
}

# Counts each distinct test once from cargo test's output (file $1): a test
# is its binary (the "Running" line's source file and executable without
# cargo's hash, or the crate of a "Doc-tests" line) and its name, so a binary
# run twice (comm's tests with and without `mpi`) counts once. A test that
# failed in any run counts as failed, else one that passed in any run as
# passed, else as ignored. Lines inside a "failures:" report (a child test
# process's output) are not results. Where a run's "test result:" line
# reports more than its named lines (another program wrote into one), the
# difference is counted as reported and said. Prints the ignored tests with
# their reason, the failed ones, then the totals line last.
count_tests() {
    awk '
    function end_run(   extra) {
        if (have_result) {
            extra = (rp > np ? rp - np : 0) + (rf > nf ? rf - nf : 0) + (ri > ni ? ri - ni : 0)
            if (extra) notes = notes sprintf("note: %d result(s) of %s not matched to a test name; counted as reported\n", extra, bin)
            up += (rp > np ? rp - np : 0); uf += (rf > nf ? rf - nf : 0); ui += (ri > ni ? ri - ni : 0)
        }
        np = nf = ni = rp = rf = ri = have_result = infail = 0
    }
    function count(what) {
        return match($0, "[0-9]+ " what) ? substr($0, RSTART, RLENGTH) + 0 : 0
    }
    { gsub(/\033\[[0-9;]*[A-Za-z]/, ""); sub(/\r$/, "") }
    /^ *Running / {
        end_run()
        line = $0
        sub(/^ *Running (unittests )?/, "", line)
        exe = line; src = ""
        if (line ~ / \(.*\)$/) {
            src = line; sub(/ \(.*$/, "", src)
            sub(/^.* \(/, "", exe); sub(/\)$/, "", exe)
        }
        sub(/^.*\//, "", exe); sub(/-[0-9a-f]+$/, "", exe)
        bin = src == "" ? exe : exe " (" src ")"
        next
    }
    /^ *Doc-tests / { end_run(); bin = "doc-tests " $2; next }
    /^failures:$/ { infail = 1; next }
    /^test result: / {
        infail = 0; have_result = 1
        rp = count("passed"); rf = count("failed"); ri = count("ignored")
        next
    }
    /^test .* \.\.\. (ok|FAILED|ignored)/ && !infail {
        at = index($0, " ... ")
        name = substr($0, 6, at - 6); result = substr($0, at + 5)
        key = bin ": " name
        if (result ~ /^FAILED/) { rank = 3; nf++ }
        else if (result ~ /^ok/) { rank = 2; np++ }
        else { rank = 1; ni++; why[key] = result }
        if (rank > best[key]) best[key] = rank
        next
    }
    END {
        end_run()
        for (key in best) {
            if (best[key] == 3) failed++
            else if (best[key] == 2) passed++
            else ignored++
        }
        if (ignored) {
            printf "ignored (%d):\n", ignored; fflush()
            for (key in best) if (best[key] == 1) {
                reason = why[key]; sub(/^ignored,? */, "", reason)
                print "  " key (reason == "" ? "" : "  (" reason ")") | "sort"
            }
            close("sort")
        }
        if (failed) {
            printf "failed (%d):\n", failed; fflush()
            for (key in best) if (best[key] == 3) print "  " key | "sort"
            close("sort")
        }
        printf "%s", notes
        printf "%d passed, %d failed, %d ignored\n", passed + up, failed + uf, ignored + ui
    }' "$1"
}

# wgpu loads libwayland-client, which prints "XDG_RUNTIME_DIR is invalid or
# not set in the environment" each time it looks for a display while that
# is unset or not an absolute path (root in CI has none): ~30 lines that are
# no failure. A private folder (mktemp -d: 0700) stops them at the cause, and
# cohort's own run files go there too; it is removed at the end.
runtime_dir=""
if [[ "${XDG_RUNTIME_DIR:-}" != /* ]] || [ ! -d "$XDG_RUNTIME_DIR" ] || [ ! -O "$XDG_RUNTIME_DIR" ] ||
    [ "$(stat -c %a "$XDG_RUNTIME_DIR")" != 700 ]; then
    runtime_dir=$(mktemp -d "${TMPDIR:-/tmp}/cohort-runtime.XXXXXX")
    export XDG_RUNTIME_DIR=$runtime_dir
fi

# On any exit: the step that failed, if one did, then the tests by name and
# the totals line; the exit status stays the failing step's.
finish() {
    local status=$?
    trap - EXIT
    if ((status)); then
        echo "scripts/test.sh: failed in step \"$step\" (exit status $status)" >&2
    fi
    printf '\n== totals (each distinct test once)\n'
    count_tests "$test_log" || true
    rm -f "$test_log"
    [ -z "$runtime_dir" ] || rm -rf "$runtime_dir"
    exit "$status"
}
trap finish EXIT

install_packages() {
    # Debian packages the tests use. Installed only when missing, so a second
    # run costs nothing.
    local wanted=("$@") missing=()
    for pkg in "${wanted[@]}"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    if ((${#missing[@]})); then
        log "installing ${missing[*]}"
        local sudo=""
        [ "$(id -u)" -ne 0 ] && sudo="sudo"
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
    fi
}

# Software Vulkan (lavapipe) for the wgpu backend's tests; Open MPI and
# libclang for the `mpi` feature and the mpirun tests; python3 for the
# launcher's torchrun tests (a .py rank runs under python3).
if command -v apt-get >/dev/null 2>&1; then
    install_packages mesa-vulkan-drivers libvulkan1 libopenmpi-dev openmpi-bin libclang-dev python3
fi

# The mpirun and torchrun tests fail without these; say so here, before the
# long build.
if ! command -v mpirun >/dev/null 2>&1; then
    echo "error: mpirun is not installed: the mpirun tests need Open MPI (apt-get install openmpi-bin libopenmpi-dev)" >&2
    exit 1
fi
if ! command -v python3 >/dev/null 2>&1; then
    echo "error: python3 is not installed: the launcher's torchrun tests run .py ranks with it (apt-get install python3)" >&2
    exit 1
fi

if ! cargo fmt --version >/dev/null 2>&1 && command -v rustup >/dev/null 2>&1; then
    rustup component add rustfmt clippy
fi

export COHORT_LOG="${COHORT_LOG:-warn}"
# A clean clone gains nothing from incremental state, and it costs gigabytes.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# Open MPI refuses to run as root unless told it may (CI runs as root).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

log "cargo fmt --check"
cargo fmt --all -- --check

log "cargo clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets -- -D warnings

log "cargo test --workspace"
run_tests cargo test --workspace --all-targets

log "cohort-comm with the mpi feature (rsmpi over Open MPI)"
run_tests cargo test -p cohort-comm --features mpi --all-targets

log "the collective suite under mpirun over the MPI transport"
run_tests cargo test -p cohort-launch --features mpi --test communicator_mpi

log "the stage clock compiled in (cohort-runtime's stage-clock feature)"
run_tests cargo test -p cohort-runtime --features stage-clock --lib stages

log "doc tests"
run_tests cargo test --workspace --doc

log "examples run (quick settings)"
cargo run -q --example memory_pools >/dev/null
# The main job both ways: one process for 4 CPU devices, and one process
# per device through the launcher (each checks its replicas and loss).
cargo run -q --example data_parallel -- --epochs 2 --steps 16 | tail -4
cargo build -q -p cohort-launch --bin cohort
bin=${CARGO_TARGET_DIR:-target}/debug
"$bin/cohort" run -n 4 -- "$bin/examples/data_parallel" --epochs 2 --steps 16 | tail -4

log "a CPU-only build: the facade without its default features has no cudarc nor wgpu"
if cargo tree -p cohort --no-default-features -e normal | grep -E '(cudarc|wgpu) v'; then
    echo "cudarc or wgpu is in the CPU-only build of the cohort package" >&2
    exit 1
fi
cargo check -q -p cohort --no-default-features --all-targets

log "cargo doc (warnings, such as links to private items, are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc -q --workspace --no-deps

log "all checks and tests passed"
