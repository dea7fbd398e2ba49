#!/usr/bin/env bash
# One short GPU lease in one call: unpacks the bundle of scripts/bundle.sh and runs
# scripts/gpu_check.sh's steps in parts, most telling first, each part under a time cap of
# its own and all of them under one budget, so that a part that hangs or runs long costs the
# parts after it at most its cap. The logs of every part come back as one archive (a lease
# may return only a few files), and the parts' summaries are printed last.
#
#   bash scripts/gpu_lease.sh BUNDLE.tar.xz OUT_DIR BUDGET_SECONDS PART...
#
# PART: gpu_check.sh's steps, comma-separated, then ':' and the part's cap in seconds. A part
# gets its cap or what is left of the budget, whichever is less, and is skipped when under
# 20 s are left. gpu_check.sh's variables (ROUNDS, GPT_ROUNDS, FLOAT8_STEPS, ...) pass through.
# Writes OUT_DIR/logs.tgz (a folder per part, named by its number). A lease of 15 minutes of
# device time, of which starting the machine takes about 35 s (H200, 2026-11-30: fresh, ops
# and tests 75 s; gpt through its float32 runs 110 s; gptprofile 47 s; f8profile over 30 s,
# its step has 3,735 kernels):
#
#   GPT_ROUNDS=1 ROUNDS=1 FLOAT8_STEPS=60 bash scripts/gpu_lease.sh \
#     build-bundle/mixtape-bundle.tar.xz "$OUT" 420 fresh,ops,tests:110 gpt:120 gptprofile:60 \
#     f8profile:75 float8:55
set -uo pipefail
if [[ $# -lt 4 ]]; then
  echo "usage: gpu_lease.sh BUNDLE.tar.xz OUT_DIR BUDGET_SECONDS PART..." >&2
  exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
archive="$1"
out="$2"
budget="$3"
shift 3
for spec in "$@"; do
  [[ "$spec" =~ ^[a-z0-9,]+:[0-9]+$ ]] || { echo "gpu_lease.sh: not STEPS:SECONDS: '$spec'" >&2; exit 2; }
done
[[ "$budget" =~ ^[0-9]+$ ]] || { echo "gpu_lease.sh: not a number of seconds: '$budget'" >&2; exit 2; }
work="$(mktemp -d)"
tar -xJf "$archive" -C "$work" || { echo "gpu_lease.sh: cannot unpack $archive" >&2; exit 1; }
bundle="$work/$(tar -tJf "$archive" | head -1 | cut -d/ -f1)"
reference="$bundle/bench/reference_pytorch.py"
[[ -f "$reference" ]] || reference=""
end=$((SECONDS + budget))
part=0
for spec in "$@"; do
  part=$((part + 1))
  steps="${spec%:*}"
  cap="${spec##*:}"
  left=$((end - SECONDS))
  ((left < cap)) && cap=$left
  if ((cap < 20)); then
    echo "part $part ($steps): not run, ${left} s of the budget left" >>"$work/skipped.txt"
    continue
  fi
  DEADLINE=$cap bash "$here/gpu_check.sh" "$bundle" "$work/logs/$part" "$reference" "$steps" \
    >/dev/null 2>&1
done
mkdir -p "$out"
tar -czf "$out/logs.tgz" -C "$work" logs $([[ -f "$work/skipped.txt" ]] && echo skipped.txt)
for summary in "$work"/logs/*/summary.txt; do
  echo "### part $(basename "$(dirname "$summary")")"
  cat "$summary"
done
cat "$work/skipped.txt" 2>/dev/null
rm -rf "$work"
