#!/usr/bin/env bash
# Builds mixtape (Release) in build/ and runs the MNIST trainer (apps/mnist) with its
# defaults: MNIST is fetched when missing, the MLP trains for 5 epochs, the test accuracy
# is printed. Installs the Debian packages it needs first, when missing (scripts/deps.sh).
# Arguments are passed to the app (`bash scripts/train.sh --help` lists them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The app this script builds and runs: a CMake executable target under apps/.
app=mixtape-mnist

bash scripts/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build --parallel "$(nproc)" --target "$app"
bin="$(find build/apps -type f -name "$app" -perm -u+x -print -quit)"
if [[ -z "$bin" ]]; then
  echo "train.sh: $app was not found under build/apps" >&2
  exit 1
fi
exec "$bin" "$@"
