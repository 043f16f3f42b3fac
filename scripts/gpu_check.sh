#!/usr/bin/env bash
# Device check (run on a lent GPU machine with `.gpuwheels` carried; see docs/development.md):
# the CUDA paths of the engine and the built-in task, a node training on the GPU, a mixed
# swarm (one GPU node, one CPU node) that must end with one param_digest, and a 1-GPU torchrun
# member (DistributedDataParallel over NCCL with one rank; the multi-GPU case: docs/multi-gpu.md).
set -u
pip install -q --no-index --find-links .gpuwheels --target /tmp/site grpcio grpcio-health-checking \
    protobuf zstandard cryptography cffi pytest-asyncio prometheus-client uvloop 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import torch, grpc, google.protobuf as p; print(torch.__version__, torch.cuda.get_device_name(0), grpc.__version__, p.__version__)"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_diloco_engine.py tests/test_training_task.py 2>&1 | tail -3
timeout 120 python3 -m neuronode.cli start --device cuda --rounds 3 --inner-steps 50 --data-dir /tmp/g1 \
    --listen 127.0.0.1:0 --threads 4 2>&1 | grep -E "val_loss|round . done|ERROR|Error"
python3 -m neuronode.cli start --device cuda --rounds 3 --inner-steps 30 --data-dir /tmp/m1 \
    --listen 127.0.0.1:7901 --threads 2 --heartbeat-s 0.5 > /tmp/m1.log 2>&1 &
python3 -m neuronode.cli start --device cpu --rounds 3 --inner-steps 30 --data-dir /tmp/m2 \
    --listen 127.0.0.1:7902 --peers 127.0.0.1:7901 --threads 4 --heartbeat-s 0.5 > /tmp/m2.log 2>&1 &
wait
grep -hE "round . done|ERROR" /tmp/m1.log /tmp/m2.log | cut -c1-170
timeout 180 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m neuronode start --device cuda \
    --rounds 2 --inner-steps 30 --data-dir /tmp/t1 --listen 127.0.0.1:0 --threads 2 > /tmp/t1.log 2>&1
echo "torchrun 1-GPU member: exit $?"
grep -hE "round . done|rank 0|ERROR|Error" /tmp/t1.log | cut -c1-170
python3 -m neuronode status --data-dir /tmp/t1 --json | grep -E '"(round|local_workers)"'
cp /tmp/m1.log /tmp/m2.log /tmp/t1.log "${OUT:-/tmp}/" 2>/dev/null || true
