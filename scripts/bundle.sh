#!/usr/bin/env bash
# Builds a relocatable bundle of the conformance sweep, the CUDA test suite, the MNIST
# trainer and the character-level GPT (with its PyTorch twin and a corpus), for a GPU machine that has the NVIDIA driver and the CUDA 13 runtime libraries
# (cudart, cuBLAS, cuBLASLt; cuDNN 9) but no compiler toolchain or Debian packages: the
# binaries are built here, and the shared libraries they need beyond glibc and CUDA
# (OpenBLAS, libgfortran, libgomp, fmt, spdlog, zlib, Open MPI's libmpi) are copied beside
# them. The bundle's programs run as one process there (world size 1: MPI is linked but
# never started, so Open MPI's plug-ins, which are not bundled, are not needed); NCCL is not
# bundled either (run.sh finds the machine's).
#
#   bash scripts/bundle.sh [OUT.tar.xz] [extra CMake arguments]
#
# Default output: build-bundle/mixtape-bundle.tar.xz. On the GPU machine:
#
#   tar -xJf mixtape-bundle.tar.xz && cd mixtape-bundle
#   ./run.sh mixtape-ops                    # every kernel of every backend against the CPU
#   ./run.sh mixtape_cuda_tests             # the CUDA test suite
#   ./run.sh mixtape-mnist --device cuda --data-dir data
#   ./run.sh mixtape-charlm --device cuda --text data/charlm.txt
#
# run.sh puts the bundle's lib/ and the CUDA / cuDNN library folders it finds on
# LD_LIBRARY_PATH (CUDNN_LIB_DIR overrides the cuDNN search; otherwise a Python with the
# nvidia-cudnn wheel is asked, then /usr and /opt are searched for libcudnn.so.9). Built with CUDA architecture 90 (Hopper) unless
# CMAKE_CUDA_ARCHITECTURES is passed, and without oneDNN (its library alone is 40 MB); the
# MNIST files from MIXTAPE_DATA_DIR (when set) go to data/, and so does data/charlm.txt, the
# fortunes corpus in one file (the package is installed when missing); bench/charlm_reference.py
# goes to bench/, and so does the file MIXTAPE_REFERENCE names (the MNIST workloads' PyTorch
# reference) as bench/reference_pytorch.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

out="${1:-build-bundle/mixtape-bundle.tar.xz}"
[[ $# -gt 0 ]] && shift
mkdir -p "$(dirname "$out")"
out="$(cd "$(dirname "$out")" && pwd)/$(basename "$out")"
build_dir=build-bundle/build
stage=build-bundle/mixtape-bundle

# fortunes: the charlm's corpus (below), without which the bundle's gpt steps have no text
bash scripts/deps.sh fortunes
command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]] || {
  echo "bundle.sh: nvcc not found: the bundle is for the CUDA backend" >&2
  exit 1
}

cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DMIXTAPE_CUDA=ON -DMIXTAPE_ONEDNN=OFF \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DMIXTAPE_BUILD_BENCHMARKS=OFF "$@"
cmake --build "$build_dir" --parallel "$(nproc)" --target mixtape-ops mixtape_cuda_tests mixtape-mnist \
  mixtape-charlm

rm -rf "$stage"
mkdir -p "$stage/bin" "$stage/lib"
for target in mixtape-ops mixtape_cuda_tests mixtape-mnist mixtape-charlm; do
  bin="$(find "$build_dir" -type f -name "$target" -perm -u+x -print -quit)"
  [[ -n "$bin" ]] || { echo "bundle.sh: $target was not built" >&2; exit 1; }
  cp "$bin" "$stage/bin/"
  strip --strip-unneeded "$stage/bin/$target"
done

# The libraries the binaries load, less glibc's, the C++ runtime's and zlib's (every Linux
# machine with the CUDA toolkit has newer ones, which stay compatible with older builds)
# and the CUDA toolkit's own (those come from the target machine, matching its driver).
is_system_or_cuda() {
  case "$(basename "$1")" in
    ld-linux*|libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libresolv.so*) return 0 ;;
    libstdc++.so*|libgcc_s.so*|libz.so*) return 0 ;;
    libcuda.so*|libcudart.so*|libcublas.so*|libcublasLt.so*|libcudnn*.so*|libnvrtc*.so*) return 0 ;;
    libnccl.so*) return 0 ;;  # 200+ MB; run.sh finds the machine's (its CUDA, a wheel)
  esac
  return 1
}
for bin in "$stage"/bin/*; do
  ldd "$bin" | awk '/=> \// { print $3 }'
done | sort -u | while read -r lib; do
  is_system_or_cuda "$lib" && continue
  cp -L "$lib" "$stage/lib/"
done

if [[ -n "${MIXTAPE_DATA_DIR:-}" && -d "$MIXTAPE_DATA_DIR" ]]; then
  mkdir -p "$stage/data"
  cp "$MIXTAPE_DATA_DIR"/*-ubyte* "$stage/data/" 2>/dev/null || true
fi
# The charlm's corpus for the GPU machine, which has no fortunes package: the fortune files
# (no .dat indexes, no .u8 links) in name order, as one text (split 90 / 10 by --text).
fortunes=/usr/share/games/fortunes
mkdir -p "$stage/data"
find "$fortunes" -maxdepth 1 -type f ! -name '*.*' -print0 | sort -z | xargs -0 cat \
  >"$stage/data/charlm.txt"
[[ -s "$stage/data/charlm.txt" ]] || { echo "bundle.sh: no fortunes in $fortunes" >&2; exit 1; }
mkdir -p "$stage/bench"
cp bench/charlm_reference.py "$stage/bench/"
# The MNIST workloads' PyTorch reference (shared/bench/reference_pytorch.py), when
# MIXTAPE_REFERENCE names it: for gpu_check.sh's torch and profile steps.
if [[ -n "${MIXTAPE_REFERENCE:-}" ]]; then
  cp "$MIXTAPE_REFERENCE" "$stage/bench/reference_pytorch.py"
fi

cat >"$stage/run.sh" <<'EOF'
#!/usr/bin/env bash
# Runs one of the bundle's programs (bin/) with the bundle's libraries (lib/) and the
# machine's CUDA and cuDNN libraries on LD_LIBRARY_PATH.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[[ $# -ge 1 ]] || { echo "usage: run.sh PROGRAM [ARGS...] | --ldd; programs: $(ls "$here/bin")" >&2; exit 2; }
# The machine's folders found on the first run are kept in .libdirs (a Python import and a
# search of /usr and /opt cost seconds a call), searched again when one of them is gone.
cached=""
if [[ -f "$here/.libdirs" ]]; then
  cached="$(cat "$here/.libdirs")"
  IFS=: read -r -a kept <<<"$cached"
  for d in "${kept[@]}"; do [[ -d "$d" ]] || cached=""; done
fi
if [[ -n "$cached" ]]; then
  export LD_LIBRARY_PATH="$here/lib:$cached${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
dirs=()
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
  [[ -d "$d" ]] && dirs+=("$d")
done
cudnn="${CUDNN_LIB_DIR:-}"
if [[ -z "$cudnn" ]]; then
  for py in python3 /usr/bin/python3; do
    cudnn="$("$py" - 2>/dev/null <<'PY' || true
import os
try:
    import nvidia.cudnn as m
    for p in getattr(m, "__path__", []):
        lib = os.path.join(p, "lib")
        if os.path.isdir(lib):
            print(lib)
            break
except Exception:
    pass
PY
)"
    [[ -n "$cudnn" ]] && break
  done
fi
if [[ -z "$cudnn" ]]; then  # anywhere else a cuDNN 9 is installed (a wheel, a tarball)
  found="$(find /usr /opt -name 'libcudnn.so.9' -print -quit 2>/dev/null || true)"
  [[ -n "$found" ]] && cudnn="$(dirname "$found")"
fi
[[ -n "$cudnn" ]] && dirs+=("$cudnn")
found_dirs="$(IFS=:; echo "${dirs[*]}")"
# A library still missing for any program (cuBLAS, NCCL or the runtime from Python wheels,
# say): its folder under /usr/local, /opt or /usr, each library looked for once.
looked=" "
for p in "$here"/bin/*; do
  for lib in $(LD_LIBRARY_PATH="$here/lib:$found_dirs" ldd "$p" 2>/dev/null | awk '/not found/ { print $1 }'); do
    [[ "$looked" == *" $lib "* ]] && continue
    looked="$looked$lib "
    found="$(find /usr/local /opt /usr -name "$lib" -print -quit 2>/dev/null || true)"
    [[ -n "$found" && ":$found_dirs:" != *":$(dirname "$found"):"* ]] && found_dirs="$found_dirs:$(dirname "$found")"
  done
done
found_dirs="${found_dirs#:}"
echo "$found_dirs" >"$here/.libdirs" 2>/dev/null || true
export LD_LIBRARY_PATH="$here/lib:$found_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [[ "$1" == --ldd ]]; then  # what each program still lacks, with these folders
  for p in "$here"/bin/*; do
    echo "$(basename "$p"): $(ldd "$p" 2>/dev/null | awk '/not found/ { print $1 }' | tr '\n' ' ')"
  done
  exit 0
fi
program="$1"
shift
exec "$here/bin/$program" "$@"
EOF
chmod +x "$stage/run.sh"

tar -C "$(dirname "$stage")" -cJf "$out" "$(basename "$stage")"
echo "bundle.sh: wrote $out ($(du -h "$out" | cut -f1)): $(ls "$stage/bin" | tr '\n' ' ')"
