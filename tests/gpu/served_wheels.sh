#!/usr/bin/env bash
# The wheels the served-cluster phase of tests/gpu/run.sh needs on the device beyond its image (device README,
# KINDS.md's package list: the image has torch, triton, grpcio, protobuf, prometheus-client, tokenizers,
# aiohttp, uvloop, jinja2, safetensors; it lacks what the gateway, scheduler and worker import besides),
# at the versions this checkout's .venv runs, into .whl (git-ignored). grpcio and protobuf travel too: the
# stubs in protos/ are generated for protobuf 7, whatever the image's versions are. Run here, then name .whl
# in the device call's carry and start its command as the device README says (pip install --target
# /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site).
#
#   tests/gpu/served_wheels.sh [--dry-run]
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-.venv/bin/python}"
PACKAGES=(redis llguidance grpcio grpcio-health-checking grpcio-reflection protobuf googleapis-common-protos
          opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
          opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-grpc
          opentelemetry-instrumentation opentelemetry-instrumentation-grpc opentelemetry-instrumentation-redis)
pins=()
for name in "${PACKAGES[@]}"; do
    pins+=("$name==$("$PYTHON" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name")")
done
command=(python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
         --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
         --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
         --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 -d .whl "${pins[@]}")
echo "+ ${command[*]}"
[ "${1:-}" = --dry-run ] || "${command[@]}"
