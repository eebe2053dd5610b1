#!/usr/bin/env bash
# The Python packages the GPU tests and `fuser serve` need that the GPU machine lacks (it has no
# package index): their wheels for its Python 3.12 on x86-64 Linux, downloaded here into the
# git-ignored .whl/ (carry it to the GPU machine). benchmarks/gpu.sh installs what it finds
# there into a directory of its own before the suites.
#
#   bash benchmarks/gpu_wheels.sh
#
# The server's (fastapi, starlette, pydantic, uvicorn) at versions that need no opentelemetry,
# and the official openai client of the server's tests, each with what it imports that the
# machine does not have.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
  fastapi==0.115.12 starlette==0.46.2 pydantic==2.11.7 pydantic-core==2.33.2
  annotated-types==0.7.0 typing-inspection==0.4.1 uvicorn==0.34.3
  openai==1.93.0 jiter==0.10.0 distro==1.9.0 sniffio==1.3.1
)
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}" 2>&1 | grep -v '^WARNING: Location' || true
ls .whl
