#!/bin/sh
# The wheels the prepared GPU check needs beside the GPU machine's image (Python 3.12, torch,
# torchvision, transformers, onnx, onnxruntime, numpy, grpcio are there; see README.md here):
# plugserve's base dependencies the image lacks, its generate extra's llguidance, and the
# clients the check drives it with (openai, tritonclient[grpc]), NVML's bindings for the per-GPU
# metrics (nvidia-ml-py, pure Python, ~50 kB), cuda-python's bindings for tritonclient's
# cuda_shared_memory (cuda-bindings, 8.4 MB: the gpuops part's round trip), pinned to one version each,
# for CPython 3.12 on x86-64 Linux, into ./.whl (ignored by git; about 31 MB).
# usage, from the repository root, on a machine with network: sh tests/gpu/wheels.sh
set -eu
DEST=${1:-.whl}
mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$DEST" \
  grpcio==1.85.3 grpcio-health-checking==1.81.1 grpcio-reflection==1.81.1 protobuf==6.33.6 \
  httptools==0.9.0 orjson==3.13.0 pysimdjson==7.0.2 llguidance==1.9.1 setuptools==84.2.1 \
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 idna==3.20 \
  anyio==4.16.0 sniffio==1.3.1 distro==1.9.0 jiter==0.19.0 pydantic==2.14.4 \
  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0 tritonclient==2.73.0 python-rapidjson==1.25 \
  nvidia-ml-py==13.615.71 cuda-bindings==13.5.0 cuda-pathfinder==1.9.0
ls "$DEST"
