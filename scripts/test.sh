#!/usr/bin/env bash
# Installs what the tests need, then runs every check and test of the
# workspace. Used by .ci/run and by hand: `scripts/test.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."

log() {
    # Each step also prints the free disk, so a run that fills it says where.
    printf '\n== %s (disk free: %s)\n' "$*" "$(df -h --output=avail . 2>/dev/null | tail -1 | tr -d ' ')"
}

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
# libclang for the `mpi` feature and the mpirun tests.
if command -v apt-get >/dev/null 2>&1; then
    install_packages mesa-vulkan-drivers libvulkan1 libopenmpi-dev openmpi-bin libclang-dev
fi

# The mpirun tests fail without it; say so here, before the long build.
if ! command -v mpirun >/dev/null 2>&1; then
    echo "error: mpirun is not installed: the mpirun tests need Open MPI (apt-get install openmpi-bin libopenmpi-dev)" >&2
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
cargo test --workspace --all-targets

log "cohort-comm with the mpi feature (rsmpi over Open MPI)"
cargo test -p cohort-comm --features mpi --all-targets

log "the collective suite under mpirun over the MPI transport"
cargo test -p cohort-launch --features mpi --test communicator_mpi

log "the stage clock compiled in (cohort-runtime's stage-clock feature)"
cargo test -p cohort-runtime --features stage-clock --lib stages

log "doc tests"
cargo test --workspace --doc

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

log "all tests passed"
