#!/usr/bin/env bash
# Benchmarks on a lent machine with more cores than nodes (each node gets its own cores, as on
# real volunteer machines): bench sync at N=4, P=25M against gloo, JSON into $OUT.
set -u
pip install -q --no-index --find-links .gpuwheels --target /tmp/site grpcio grpcio-health-checking \
    protobuf zstandard cryptography cffi prometheus-client uvloop blake3 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
nproc
for spec in "fp32 reduce-scatter" "int8 reduce-scatter" "bf16 reduce-scatter" "fp32 all-to-all"; do
    set -- $spec
    timeout 150 python3 -m neuronode.cli bench sync --nodes 4 --params 25e6 --codec "$1" \
        --averaging "$2" --rounds 5 --json --grpc-floor > "${OUT:-/tmp}/sync-$1-$2.json" 2> "${OUT:-/tmp}/sync-$1-$2.err"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('codec','averaging','seconds','gloo_seconds','ratio_vs_gloo','grpc_floor_seconds','ratio_vs_grpc_floor','cpu_seconds','gloo_cpu_seconds','zstd_levels_used','payload_bytes_per_param','wire_bytes_per_param','replicas_identical')})" "${OUT:-/tmp}/sync-$1-$2.json" || tail -3 "${OUT:-/tmp}/sync-$1-$2.err"
done
