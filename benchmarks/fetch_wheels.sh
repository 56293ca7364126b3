#!/usr/bin/env bash
# Download, on a machine with network, the wheels gpu_check.sh installs on the offline GPU machine
# (Python 3.12, x86-64). They land in .whl/ (git-ignored); carry that folder with the run.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d "$ROOT/.whl" pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0
ls -l "$ROOT/.whl"
