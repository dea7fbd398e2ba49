#!/usr/bin/env bash
# Installs the Debian 12 packages that building and testing mixtape needs, when missing,
# plus any packages named as arguments.
# Checks with dpkg-query first: when everything is present it does nothing (and needs no
# network). Otherwise it runs `apt-get update` once and installs the missing packages,
# through sudo when not root.
set -euo pipefail

packages=(
  cmake          # >= 3.25
  g++            # C++20 (g++ 12)
  make
  pkgconf        # pkg-config
  libfmt-dev
  libspdlog-dev
  catch2         # tests
  zlib1g-dev     # gzip'd IDX files (MNIST)
  libcurl4-openssl-dev  # dataset downloads, in-process
  libarchive-dev  # npm tarballs (.tgz), read in memory
  libssl-dev     # OpenSSL's libcrypto: SHA-256 of fetched files, SHA-512 of npm tarballs
  nlohmann-json3-dev  # safetensors headers, npm registry metadata
  libcli11-dev   # the MNIST trainer's command line
  ca-certificates  # TLS for the downloads
  libopenblas-openmp-dev  # OpenBLAS sharing OpenMP's threads with mixtape's kernels
  libdnnl-dev    # oneDNN (OpenMP build): the CPU convolutions and pooling
  libbenchmark-dev
  libopenmpi-dev  # Open MPI: data-parallel training across processes (mixtape/distributed)
  openmpi-bin    # mpirun, for the distributed tests and multi-process training
  libonnx-dev    # ONNX export: ONNX's protobuf messages, checker and operator schemas
  libprotobuf-dev  # protobuf, which ONNX's messages are built on
  python3-onnx   # tests: ONNX's Python checker and shape inference read the exported files
  python3-opencv  # tests: OpenCV's DNN module runs the exported models
)
# Extra packages a caller needs.
packages+=("$@")

missing=()
for pkg in "${packages[@]}"; do
  status="$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)"
  if [[ "$status" != "installed" ]]; then
    missing+=("$pkg")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi

echo "deps.sh: installing missing Debian packages: ${missing[*]}"
sudo_cmd=()
if [[ "$(id -u)" -ne 0 ]]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "deps.sh: not root and sudo is not available; install as root: ${missing[*]}" >&2
    exit 1
  fi
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
"${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -q --no-install-recommends "${missing[@]}"
