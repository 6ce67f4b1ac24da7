#!/bin/bash
# The GPU measurements of docs/benchmarks.md, in the stages one lent H200 session runs them (see the device
# tool's README: at most 64 MiB travel per call, so the SmolLM2 GGUF (98 MB, split by
# ../shared/tools/smollm2-gpu-parts.sh) and the wheels arrive over several calls; /root persists between
# calls while the machine stays warm).
#
#   (every stage also carries .data: a copy of ../shared/data/math_train.json, which does not travel)
#   stage 1  carry .models/smol.gguf.partaa .whl/test (pytest) .whl/small/gguf*: CUDA tests (Triton, graphs,
#            sampling exactness), kernel bench, Qwen3-1.7B-shape engine bench
#   stage 2  carry .models/smol.gguf.partab .whl/small: SmolLM2-135M real-text bench (bf16 speed, fp32 exactness)
#   stage 3  carry .whl/big (pyarrow, pandas): GRPO rollouts (S3R vs TRL generation), tools/bench_grpo.py
#
# Usage on the device: bash tools/device_session.sh STAGE   (writes logs and JSON under $OUT)
set -uo pipefail
stage=$1
export PYTHONUNBUFFERED=1 PYTHONPATH=/root/site:$PWD TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /root/smol /root/site
install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site "$@"
}
log() { echo "== $(date -u +%H:%M:%S) $*"; }

case $stage in
1)
  cp .models/smol.gguf.partaa /root/smol/
  install_wheels .whl/test/*.whl .whl/small/gguf*.whl
  python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv
  log tests
  S3R_HF_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:warnings -p no:cacheprovider -rs tests/test_triton_kernels.py \
    tests/test_cuda_graphs.py tests/test_exactness_sampling.py tests/test_greedy_exactness.py 2>&1 | tee "$OUT/tests.log" | tail -40
  log kernels
  timeout 100 python3 -m s3r_hf.bench_kernels --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
  log qwen3-1.7b engine
  timeout 170 python3 -m s3r_hf.cli bench --model qwen3-1.7b --batch 64 --seq 4096,8192 --max-new-tokens 160 --acceptance 0.8 \
    --skip-generate --cuda-graphs --json "$OUT/qwen.json" 2>&1 | tee "$OUT/qwen.log"
  log qwen3-1.7b stages
  timeout 90 python3 -m s3r_hf.cli bench --model qwen3-1.7b --batch 64 --seq 4096 --max-new-tokens 96 --acceptance 0.8 \
    --skip-generate --cuda-graphs --stages 2>&1 | tee "$OUT/qwen_stages.log"
  ;;
2)
  install_wheels .whl/small/*.whl
  cat /root/smol/smol.gguf.partaa .models/smol.gguf.partab > /root/smol/SmolLM2-135M-Instruct.Q4_1.gguf
  smol=/root/smol/SmolLM2-135M-Instruct.Q4_1.gguf
  log smollm2 bf16
  python3 -m s3r_hf.cli bench --model $smol --data .data/math_train.json --batch 64 --seq 4096,7680 \
    --max-new-tokens 256 --budget 0.05,0.1 --min-budget 64 --cuda-graphs --stages --json "$OUT/smol.json" \
    --plot "$OUT/smol.png" 2>&1 | tee "$OUT/smol.log"
  log smollm2 fp32 exactness
  python3 -m s3r_hf.cli bench --model $smol --data .data/math_train.json --batch 64 --seq 4096 \
    --max-new-tokens 64 --min-budget 64 --dtype float32 --cuda-graphs --skip-generate \
    --json "$OUT/smol_fp32.json" 2>&1 | tee "$OUT/smol_fp32.log"
  ;;
3)
  install_wheels .whl/big/*.whl
  log grpo
  python3 tools/bench_grpo.py --json "$OUT/grpo.json" --plot "$OUT/grpo.png" "${@:2}" 2>&1 | tee "$OUT/grpo.log"
  ;;
esac
log done
