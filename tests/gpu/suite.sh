#!/usr/bin/env bash
# The GPU smoke suite (tests/gpu, docs/gpu.md), one entry point:
#
#   tests/gpu/suite.sh prepare   here (PyPI + the CPU SGLang of `make setup`): download the wheel set into
#                                .gpu/wheels, save the loop's rollouts and HF checkpoints into .gpu/data,
#                                check that what travels is < 64 MiB
#   tests/gpu/suite.sh run [PYTEST ARGS]
#                                on the GPU machine (Python 3.12 image, no network): install the wheels
#                                into /tmp/site, run `pytest tests/gpu` on CUDA; junit.xml, log.txt,
#                                gpu_figures.json (figures, profiles, per-test durations and the run:
#                                commit, device, result, wall time; copy it to docs/gpu-runs/) and
#                                summary.txt go to $OUT (default .gpu/out); sized for one 10-minute command
#   tests/gpu/suite.sh dry-run [PYTEST ARGS]
#                                here / CI: the suite's code paths on CPU (tiny shapes, gloo), after prepare;
#                                it also checks that the train_only path imports nothing the GPU machine lacks
#
# Environment: PY (python; default .venv/bin/python for prepare and dry-run, python3 for run),
# MRL_GPU_DIR (default .gpu), OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
export MRL_GPU_DIR=${MRL_GPU_DIR:-$REPO/.gpu}
START=$SECONDS
# The commit under test, where the checkout has its .git (a copied work tree may not: then the
# figures name the commit `prepare` recorded, as prepare_commit).
if [ -z "${MRL_GPU_COMMIT:-}" ] && git -C "$REPO" rev-parse HEAD >/dev/null 2>&1; then
  MRL_GPU_COMMIT=$(git -C "$REPO" rev-parse HEAD)
  git -C "$REPO" diff --quiet HEAD -- 2>/dev/null || MRL_GPU_COMMIT="$MRL_GPU_COMMIT+dirty"
  export MRL_GPU_COMMIT
fi

summarize() {  # junit.xml -> "N passed, M failed" (+ skipped); non-zero unless all passed
  "$PY" - "$1" <<'EOF'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
n = sum(int(s.get("tests", 0)) for s in suites)
failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
line = f"{n - failed - skipped} passed, {failed} failed" + (f", {skipped} skipped (a skip is a failure here)" if skipped else "")
print(line)
sys.exit(1 if failed or skipped or not n else 0)
EOF
}

run_pytest() {  # $1 = device; rest = pytest args
  local device=$1; shift
  mkdir -p "$OUT"
  export MRL_GPU_SUITE_DEVICE=$device MRL_GPU_FIGURES=$OUT/gpu_figures.json PYTHONUNBUFFERED=1
  rm -f "$OUT/gpu_figures.json" "$OUT/junit.xml"
  "$PY" -m pytest tests/gpu -p no:cacheprovider -o junit_family=xunit2 --junitxml="$OUT/junit.xml" \
    --basetemp="${TMPDIR:-/tmp}/mrl-gpu-suite-$$" "$@" 2>&1 | tee "$OUT/log.txt"
  if [ ! -f "$OUT/junit.xml" ]; then
    echo "0 passed, 1 failed (pytest wrote no report; see $OUT/log.txt)" | tee "$OUT/summary.txt"
    return 1
  fi
  summarize "$OUT/junit.xml" | tee "$OUT/summary.txt"
  local rc=${PIPESTATUS[0]}
  # The run itself into the figures file (docs/gpu-runs/ keeps one such file per GPU run).
  "$PY" - "$OUT" "$((SECONDS - START))" "$*" <<'EOF'
import json, sys, time
from pathlib import Path
out, wall, args = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
path = out / "gpu_figures.json"
fig = json.loads(path.read_text()) if path.exists() else {}
env = fig.get("environment", {})
env_txt = (out / "env.txt").read_text().splitlines() if (out / "env.txt").exists() else []
fig["run"] = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": env.get("commit"),
              "tree_dirty": env.get("tree_dirty"),
              "device": env_txt[0] if env_txt and "," in env_txt[0] else env.get("gpu") or env.get("device_kind"),
              "command": "tests/gpu/suite.sh " + ("run" if env.get("device_kind") == "cuda" else "dry-run")
                         + (" " + args if args else ""),
              "result": (out / "summary.txt").read_text().strip(), "wall_s": wall}
path.write_text(json.dumps(fig, indent=1, sort_keys=True))
EOF
  return "$rc"
}

cmd=${1:-}
shift || true
case "$cmd" in
  prepare)
    PY=${PY:-$REPO/.venv/bin/python}
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
    "$PY" tests/gpu/prepare.py wheels || exit 1
    "$PY" tests/gpu/prepare.py data || exit 1
    "$PY" tests/gpu/prepare.py size
    ;;
  run)
    PY=${PY:-python3}
    OUT=${OUT:-$MRL_GPU_DIR/out}
    mkdir -p "$OUT"
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
      "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
    } 2>&1 | tee "$OUT/env.txt"
    ls "$MRL_GPU_DIR"/wheels/*.whl >/dev/null 2>&1 && [ -f "$MRL_GPU_DIR/data/manifest.json" ] || {
      echo "no $MRL_GPU_DIR/wheels or data: run 'tests/gpu/suite.sh prepare' first and carry .gpu" | tee "$OUT/summary.txt"
      exit 1; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$MRL_GPU_DIR"/wheels/*.whl || exit 1
    export PYTHONPATH=$REPO:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    # One machine: gloo groups (megatron-core makes some beside NCCL's; the vocab-parallel test's
    # thread ranks) bind to loopback instead of resolving the host name.
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
    run_pytest cuda "$@"
    ;;
  dry-run)
    PY=${PY:-$REPO/.venv/bin/python}
    OUT=${OUT:-$MRL_GPU_DIR/out}
    # torch.compile (megatron-core's jit_fuser) off: its CPU backend recompiles for minutes on 2 cores
    # and is not the GPU's backend anyway; the Python code paths are the same without it.
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} CUDA_VISIBLE_DEVICES= TORCHDYNAMO_DISABLE=1
    run_pytest cpu "$@"
    ;;
  *)
    sed -n '2,16p' "$0"
    exit 2
    ;;
esac
