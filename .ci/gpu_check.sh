#!/usr/bin/env bash
# One prepared command for the minutes a GPU machine is lent (docs/reference/gpu-runs.md):
#   bash .ci/gpu_check.sh [--dry-run] [OUTDIR]        (OUTDIR defaults to $OUT, else ./gpu-check-out)
# On a machine with a CUDA GPU, from a clean checkout, with the torch it finds there (2.11 or later with CUDA):
#   1. build   installs torchqkit without dependencies and builds the CUDA extension for this GPU's architecture
#              against that torch (a build of the same sources, torch and architecture is reused), loads it and
#              prints kernels.status() for CUDA;
#   2. tests   `TRITON_INTERPRET=0 pytest -m gpu test`: Triton kernels compiled natively, C++ CUDA ops against the
#              reference, float8 training through torch._scaled_mm, tiny LLaMA under torch.compile;
#   3. bench   `python -m benchmarks kernels --device cuda`: bf16 F.linear, torch's _weight_int4pack_mm, torchao's
#              int4 if installed and each torchqkit GPU path at 4096^2 and 8192 x 28672, M = 1 / 16 / 256;
#   4. writes every log, the test report, the benchmark table and JSON, and summary.md under OUTDIR, and exits
#      non-zero if any step failed (every step runs even when an earlier one failed).
# Without a GPU it says so in one line and exits 0. --dry-run runs the same steps on CPU (no build, the gpu tests
# collected and skipped with their reasons, the benchmark's code interpreted at tiny shapes): CI runs it
# (test/ci/test_gpu_check.py). Budget on an H100 / H200: docs/reference/gpu-runs.md.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
OUTDIR=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    -*) echo "gpu_check: unknown option $arg (usage: bash .ci/gpu_check.sh [--dry-run] [OUTDIR])" >&2; exit 2 ;;
    *) OUTDIR=$arg ;;
  esac
done
OUTDIR=${OUTDIR:-${OUT:-$PWD/gpu-check-out}}
PY=${PYTHON:-python}

# First line: which torch and GPU this is, and what the command needs.
PROBE=$("$PY" - <<'PY' 2>&1
import torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
cap = "%d%d" % torch.cuda.get_device_capability(0) if gpu else ""
print(f"{torch.__version__}|{torch.version.cuda}|{gpu}|{cap}")
PY
) || { echo "gpu_check: needs python with torch (2.11 or later, a CUDA build on a GPU machine): $PROBE"; exit 2; }
IFS='|' read -r TORCH_VERSION TORCH_CUDA GPU_NAME GPU_CAP <<<"$PROBE"
if [ -z "$GPU_NAME" ] && [ "$DRY_RUN" = 0 ]; then
  echo "gpu_check: no CUDA GPU here (torch $TORCH_VERSION, CUDA ${TORCH_CUDA}): nothing to check; --dry-run rehearses the steps on CPU"
  exit 0
fi
if [ "$DRY_RUN" = 1 ] && [ -n "$GPU_NAME" ]; then
  echo "gpu_check: --dry-run is the CPU rehearsal, but this machine has $GPU_NAME: run without --dry-run" >&2
  exit 2
fi
mkdir -p "$OUTDIR" || { echo "gpu_check: can't create $OUTDIR" >&2; exit 2; }
MODE=$([ "$DRY_RUN" = 1 ] && echo "dry run on CPU" || echo "$GPU_NAME (sm_$GPU_CAP)")
echo "gpu_check: torch $TORCH_VERSION (CUDA $TORCH_CUDA), $MODE; needs torch >= 2.11; output in $OUTDIR"

START=$(date +%s)
SUMMARY="$OUTDIR/summary.md"
FAILED=0
{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo "- machine: $MODE, $(nproc) cores; torch $TORCH_VERSION (CUDA $TORCH_CUDA); python $("$PY" -c 'import sys; print(sys.version.split()[0])')"
  if git rev-parse HEAD >/dev/null 2>&1; then
    echo "- commit: $(git rev-parse HEAD)$(git diff --quiet HEAD 2>/dev/null || echo ' (with local changes)')"
  else
    echo "- commit: unknown (this copy of the checkout has no git history)"
  fi
  echo
  echo "| step | result | seconds |"
  echo "|---|---|---|"
} >"$SUMMARY"

# step NAME LIMIT_S FUNCTION: runs one of the functions below in a child bash with a time limit (timeout can't run
# a function itself: they and their settings are exported), its output in NAME.log and on the terminal.
step() {
  local name=$1 limit=$2 fn=$3
  local t0 rc
  t0=$(date +%s)
  echo "gpu_check: [$name] $fn"
  timeout --kill-after=10 "$limit" bash -c "$fn" 2>&1 | tee "$OUTDIR/$name.log"
  rc=${PIPESTATUS[0]}
  local took=$(( $(date +%s) - t0 )) result
  case $rc in
    0) result="ok" ;;
    124|137) result="FAILED: past its ${limit} s limit" ;;
    *) result="FAILED (exit $rc)" ;;
  esac
  [ "$rc" = 0 ] || FAILED=1
  echo "| $name | $result | $took |" >>"$SUMMARY"
  echo "gpu_check: [$name] $result in $took s"
}

# 1. build: the CUDA extension for this GPU only (one architecture: a quarter of the compile time of the release
# build's three). The C++ CPU kernels aren't built here (no GPU test needs them): the loader says so, deliberately.
export TORCHQKIT_DISABLE_CPU_EXTENSION=1
build() {
  local arch=$GPU_CAP
  [ "$arch" = 90 ] && arch=90a  # Hopper's wgmma / setmaxnreg need the arch-specific target
  local stamp
  stamp=$(cat csrc/cuda/* csrc/common/* setup.py | sha256sum | cut -c1-16)-$TORCH_VERSION-$arch
  if ls torchqkit/_C_cuda*.so >/dev/null 2>&1 && [ "$(cat torchqkit/_C_cuda.fingerprint 2>/dev/null)" = "$stamp" ]; then
    echo "gpu_check: reusing torchqkit/_C_cuda (built from these sources with this torch for sm_$arch)"
  else
    "$PY" -c "import setuptools" || { echo "gpu_check: setuptools is missing: the extension can't build"; return 1; }
    rm -f torchqkit/_C_cuda*.so torchqkit/_C_cuda.fingerprint
    export TORCHQKIT_BUILD_CPU=0 TORCHQKIT_CUDA_REQUIRED=1 TORCHQKIT_CUDA_ARCHS=$arch MAX_JOBS=$(nproc)
    # --no-index: the GPU machine has no package registry, and pip must not wait for one.
    if ! "$PY" -m pip install --no-deps --no-build-isolation --no-index -e .; then
      # pip's editable install needs a recent setuptools / wheel; the in-place build needs only setuptools, and
      # the tests and benchmarks import torchqkit from this checkout (they run from its root).
      echo "gpu_check: pip install -e failed (above); building the extension in place instead"
      "$PY" setup.py -q build_ext --inplace || return 1
    fi
    ls torchqkit/_C_cuda*.so >/dev/null 2>&1 || { echo "gpu_check: no torchqkit/_C_cuda*.so after the build"; return 1; }
    echo "$stamp" >torchqkit/_C_cuda.fingerprint
  fi
  cuda_status
}

# kernels.status() for cuda; exits 1 where the CUDA extension should have loaded (not in a dry run) and didn't.
cuda_status() {
  TRITON_INTERPRET=$DRY_RUN "$PY" - "$DRY_RUN" <<'PY'
import sys
from torchqkit import kernels
print(f"CUDA extension loaded: {kernels.CUDA_EXTENSION_LOADED} ({kernels.CUDA_EXTENSION_REASON}); C++ CUDA ops: "
      f"{', '.join(kernels.CUDA_OPS) or 'none'}")
for row in kernels.backend_status(devices=("cuda",)):
    print(f"  {row['linear']}: {row['path']} ({row['why']})")
sys.exit(0 if sys.argv[1] == "1" or (kernels.CUDA_EXTENSION_LOADED and kernels.CUDA_OPS) else 1)
PY
}

# 2. tests: on a GPU the gpu-marked tests must run and pass; in a dry run they must be collected and skip (no
# collection errors, no failures), which proves the test files import and parametrize as they will on the GPU.
# Triton compiles and autotunes each kernel in the process that calls it, one at a time: the tests run as parallel
# groups (the machine's cores compile concurrently), and the groups together must cover every gpu test.
TEST_GROUPS=(
  "cuda-int4|test/kernels/cuda|int4"
  "cuda-other|test/kernels/cuda|not int4"
  "triton-int4|test/kernels/triton/test_triton_kernels.py|int4"
  "triton-int8-nf4|test/kernels/triton/test_triton_kernels.py|int8 or nf4"
  "triton-mx-fp8|test/kernels/triton/test_triton_kernels.py|not int4 and not int8 and not nf4"
  "triton-nm-sparse-kv|test/kernels/triton/test_nm_sparse.py test/kernels/triton/test_quantized_kv_attention.py|"
  "paths-opcheck-moe|test/kernels/triton/test_layout_paths.py test/kernels/triton/test_opcheck.py test/moe/test_expert_backends.py|"
  "training|test/training|"
  "end-to-end|test/end_to_end|"
)
gpu_tests() {
  [ -n "${TEST_GROUPS_DECL:-}" ] && eval "$TEST_GROUPS_DECL"
  local interpret=$([ "$DRY_RUN" = 1 ] && echo 1 || echo 0) work pids=() names=() g name paths expr
  work=$(mktemp -d)  # per-group files stay out of OUTDIR: the device returns 8 files at most
  for g in "${TEST_GROUPS[@]}"; do
    IFS='|' read -r name paths expr <<<"$g"
    # shellcheck disable=SC2086  # paths is a list of test paths
    TRITON_INTERPRET=$interpret "$PY" -m pytest -m gpu $paths -k "$expr" -q -rfEs -p no:cacheprovider \
      --junitxml="$work/$name.xml" >"$work/$name.log" 2>&1 &
    pids+=($!)
    names+=("$name")
  done
  local i rc=0
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || rc=1
    echo "=== group ${names[$i]}"
    cat "$work/${names[$i]}.log"
  done
  TRITON_INTERPRET=1 "$PY" -m pytest -m gpu test -q --collect-only -p no:cacheprovider >"$work/all.log" 2>&1 || rc=1
  "$PY" - "$work" "$OUTDIR/gpu-tests.xml" "$DRY_RUN" <<'PY' || rc=1
import glob
import os
import re
import sys
import xml.etree.ElementTree as ET
work, out, dry = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
merged = ET.Element("testsuites")
counts = dict(tests=0, failures=0, errors=0, skipped=0)
modules = set()  # test modules skipped whole at collection (a missing optional package): junit counts them as tests
for path in sorted(glob.glob(os.path.join(work, "*.xml"))):
    root = ET.parse(path).getroot()
    for suite in ([root] if root.tag == "testsuite" else list(root)):
        suite.set("name", os.path.basename(path)[:-4])
        merged.append(suite)
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            skip = case.find("skipped")
            if not case.get("classname") and skip is not None and skip.get("message") == "collection skipped":
                counts["tests"] -= 1
                counts["skipped"] -= 1
                reason = ((skip.text or "").strip().splitlines() or [""])[-1].strip("()'\"")[-160:]
                modules.add(f"{case.get('name')}: {reason}")
ET.ElementTree(merged).write(out, encoding="utf-8", xml_declaration=True)
for module in sorted(modules):
    print(f"skipped whole at collection (its gpu tests, if any, didn't run): {module}")
total = re.search(r"(\d+)(?:/\d+)? tests? collected", open(os.path.join(work, "all.log")).read())
total = int(total.group(1)) if total else -1
failed = counts["failures"] + counts["errors"]
passed = counts["tests"] - failed - counts["skipped"]
print(f"gpu tests: {counts['tests']} run in groups of {total} gpu-marked, {passed} passed, {failed} failed, "
      f"{counts['skipped']} skipped")
if counts["tests"] != total:
    sys.exit(f"the test groups in .ci/gpu_check.sh ran {counts['tests']} tests but {total} are gpu-marked: "
             "a group is missing or overlaps")
if not dry and counts["skipped"]:
    sys.exit(f"{counts['skipped']} gpu test(s) skipped on a GPU machine: each skip above says why")
PY
  rm -rf "$work"
  return $rc
}

# 3. bench: the GPU table and its JSON lines (a dry run: the same code interpreted on CPU, tiny shapes, no figures).
bench() {
  if [ "$DRY_RUN" = 1 ]; then
    TRITON_INTERPRET=1 "$PY" -m benchmarks kernels --device cuda --dry-run --reps 1 --out "$OUTDIR/gpu-kernels.jsonl"
  else
    TRITON_INTERPRET=0 "$PY" -m benchmarks kernels --device cuda --out "$OUTDIR/gpu-kernels.jsonl"
  fi
}

export DRY_RUN OUTDIR PY GPU_CAP TORCH_VERSION
export -f build cuda_status gpu_tests bench
# bash exports no arrays: gpu_tests reads TEST_GROUPS through this line
export TEST_GROUPS_DECL=$(declare -p TEST_GROUPS)
# Limits: the device allows 10 minutes per command; these sum to 8 (the budget in docs/reference/gpu-runs.md).
if [ "$DRY_RUN" = 1 ]; then
  step build 60 cuda_status
else
  step build 150 build
fi
step tests 240 gpu_tests
step bench 90 bench
TOTAL=$(( $(date +%s) - START ))
{
  echo
  echo "total: $TOTAL s; $([ "$FAILED" = 0 ] && echo "every step passed" || echo "FAILED: see the step logs")"
  grep -h "^gpu tests:" "$OUTDIR/tests.log" 2>/dev/null | sed 's/^/- /'
} >>"$SUMMARY"
# run.json: what `python .ci/gpu_record.py OUTDIR` writes into docs/reference/gpu-runs.md and the benchmark results.
"$PY" - "$SUMMARY" "$OUTDIR/run.json" "$MODE" "$TORCH_VERSION" "$TOTAL" "$DRY_RUN" <<'PY'
import json
import re
import subprocess
import sys
summary, out, mode, torch_version, total, dry = sys.argv[1:]
text = open(summary).read()
steps = dict(re.findall(r"^\| (\w+) \| ([^|]+?) \|", text, re.M))
tests = re.search(r"gpu tests: (\d+) run in groups of (-?\d+) gpu-marked, (\d+) passed, (\d+) failed, (\d+) skipped",
                  text)
try:
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:  # no git on the GPU machine
    commit = ""
json.dump({"date": re.search(r"^# gpu_check (\S+)", text).group(1), "machine": mode, "torch": torch_version,
           "commit": commit or "unknown", "dry_run": dry == "1", "seconds": int(total),
           "steps": {k: v for k, v in steps.items() if k != "step"},
           "tests": dict(zip(("run", "marked", "passed", "failed", "skipped"), map(int, tests.groups())))
           if tests else None}, open(out, "w"), indent=1)
PY
cat "$SUMMARY"
exit $FAILED
