#!/usr/bin/env bash
# The Metal kernels' simulator tests under AddressSanitizer and UndefinedBehaviorSanitizer.
#
#   scripts/kernels/msl_sanitize.sh            # a subset: every kernel source, its main test (~3 min)
#   scripts/kernels/msl_sanitize.sh --all      # every simulator test (pytest -m msl; ~12 min on 2 cores, warm)
#   scripts/kernels/msl_sanitize.sh -k moe     # other arguments go to pytest
#
# The compiler is $COLIBRI_MSL_CLANG, else clang++-19 when installed (its UBSan checks more,
# calls through a pointer of the wrong function type among them), else the simulator's default.
# Any sanitizer report fails the launch that made it, so a clean run is a passing run.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if [ -z "${COLIBRI_MSL_CLANG:-}" ] && command -v clang++-19 >/dev/null 2>&1; then
  export COLIBRI_MSL_CLANG=clang++-19
fi
export COLIBRI_MSL_SANITIZE=address,undefined

SUBSET=(
  tests/msl/test_simulator.py
  "tests/test_qgemv_msl.py::test_every_fmt_and_shape"
  "tests/test_qgemv_msl.py::test_launch_variants"
  "tests/test_moe_mla_msl.py::test_moe_every_fmt"
  "tests/test_moe_mla_msl.py::test_hadamard_matches_float64"
  "tests/test_moe_mla_msl.py::test_mla_one_layer_across_decode_steps"
  "tests/test_moe_mla_msl.py::test_mla_rows_matches_float64"
  "tests/test_moe_mla_msl.py::test_mla_qb_qabs_matches_float64"
  "tests/test_moe_mla_msl.py::test_mla_wide"
  "tests/test_router.py::test_kernel_matches_oracle"
  "tests/test_moe_shared_slot.py::test_shared_slot_in_simulator"
)
if [ "${1:-}" = "--all" ]; then
  shift
  exec "$PY" -m pytest -q -m msl -p no:cacheprovider "$@"
elif [ $# -gt 0 ]; then
  exec "$PY" -m pytest -q -m msl -p no:cacheprovider "$@"
fi
exec "$PY" -m pytest -q -m msl -p no:cacheprovider "${SUBSET[@]}"
