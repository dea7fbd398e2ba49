#!/usr/bin/env bash
# Builds mixtape (Release, warnings as errors) in build/ and runs the whole test suite
# with CTest. Installs the Debian packages it needs first, when missing (scripts/deps.sh).
# Exits with CTest's status. Extra arguments are passed to the CMake configure step,
# e.g. `bash scripts/test.sh -DMIXTAPE_CUDA=OFF`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/deps.sh

jobs="$(nproc)"
build_dir=build
start=$SECONDS

cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DMIXTAPE_WERROR=ON "$@"
cmake --build "$build_dir" --parallel "$jobs"
echo "test.sh: configured and built in $((SECONDS - start)) s"

# CTest's summary closes the run, and its status is the script's.
exec ctest --test-dir "$build_dir" --output-on-failure -j"$jobs"
