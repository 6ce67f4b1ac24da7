#!/bin/bash
# The GPU measurements of docs/benchmarks.md, in the stages one lent H200 session runs them (see the device
# tool's README: at most 64 MiB travel per call, so the SmolLM2 GGUF (98 MB, split by
# ../shared/tools/smollm2-gpu-parts.sh) and the wheels arrive over several calls; /root persists between
# calls while the machine stays warm).
#
#   (every stage also carries .data: a copy of ../shared/data/math_train.json, which does not travel)
#   stage 1  carry .models/smol.gguf.partaa .whl/test (pytest) .whl/small/gguf*: CUDA tests (Triton, graphs,
#            compiled layers, sampling exactness), kernel bench (KERNELS=1), graph-timed launch-setting sweep
#            (TUNE=1), Qwen3-1.7B-shape engine bench (QWEN_ARGS, default --compile-layers)
#   stage 2  carry .models/smol.gguf.partab .whl/small: SmolLM2-135M real-text bench (bf16 speed, SMOL_ARGS,
#            default --compile-layers; fp32 exactness with FP32=1). The machine is released after 30 s idle:
#            when stage 1 ran earlier, a quick call that only copies partaa to /root/smol must come first.
#   stage 3  carry .whl/big (pyarrow, pandas): GRPO rollouts (S3R vs TRL generation), tools/bench_grpo.py
#            (plot locally: python tools/bench_grpo.py --from-json grpo.json --plot grpo.png)
#
# Usage on the device: bash tools/device_session.sh STAGE   (writes logs and JSON under $OUT)
set -uo pipefail
stage=$1
# Wheels go to a folder named site-packages: dill (through datasets) pickles modules found elsewhere by value.
export PYTHONUNBUFFERED=1 PYTHONPATH=/root/site-packages:$PWD TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 \
  HF_DATASETS_OFFLINE=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /root/smol /root/site-packages
install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site-packages "$@"
}
log() { echo "== $(date -u +%H:%M:%S) $*"; }

case $stage in
1)
  cp .models/smol.gguf.partaa /root/smol/
  install_wheels .whl/test/*.whl .whl/small/gguf*.whl
  python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name())"
  log tests
  S3R_HF_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:warnings -p no:cacheprovider -rs \
    ${TESTS:-tests/test_triton_kernels.py tests/test_cuda_graphs.py tests/test_exactness_sampling.py tests/test_greedy_exactness.py tests/test_compiled_layers.py} 2>&1 | tee "$OUT/tests.log" | tail -40
  if [ "${KERNELS:-0}" = 1 ]; then
    log kernels
    timeout 100 python3 -m s3r_hf.bench_kernels --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
  fi
  if [ "${TUNE:-0}" = 1 ]; then
    log kernel launch settings, graph-timed
    timeout 200 python3 tools/tune_kernels.py --json "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log"
  fi
  log qwen3-1.7b engine, stages
  timeout 170 python3 -m s3r_hf.cli bench --model qwen3-1.7b --batch 64 --seq ${QWEN_SEQ:-4096,8192} --max-new-tokens 160 \
    --acceptance 0.8 --skip-generate --cuda-graphs --stages ${QWEN_ARGS:---compile-layers} --json "$OUT/qwen.json" 2>&1 | tee "$OUT/qwen.log"
  ;;
2)
  install_wheels .whl/small/*.whl
  cp .data/math_train.json /root/math_train.json
  cat /root/smol/smol.gguf.partaa .models/smol.gguf.partab > /root/smol/SmolLM2-135M-Instruct.Q4_1.gguf
  smol=/root/smol/SmolLM2-135M-Instruct.Q4_1.gguf
  log smollm2 bf16
  timeout 300 python3 -m s3r_hf.cli bench --model $smol --data .data/math_train.json --batch 64 --seq 4096,7680 \
    --max-new-tokens 256 --budget 0.05,0.1 --min-budget 64 --cuda-graphs --stages ${SMOL_ARGS:---compile-layers} \
    --json "$OUT/smol.json" --plot "$OUT/smol.png" 2>&1 | tee "$OUT/smol.log"
  if [ "${FP32:-0}" = 1 ]; then
    log smollm2 fp32 exactness
    timeout 150 python3 -m s3r_hf.cli bench --model $smol --data .data/math_train.json --batch 64 --seq 4096 \
      --max-new-tokens 48 --budget 0.05 --min-budget 64 --dtype float32 --cuda-graphs --compile-layers --skip-generate \
      --json "$OUT/smol_fp32.json" 2>&1 | tee "$OUT/smol_fp32.log"
  fi
  log profile
  timeout 150 python3 tools/profile_engine.py --model $smol --batch 64 --seq 4096 --max-new-tokens 48 --cuda-graphs \
    --rows 30 > "$OUT/profile.log" 2>&1; grep -B2 -A40 "=====" "$OUT/profile.log" | head -150
  ;;
3)
  install_wheels .whl/big/*.whl
  log grpo
  timeout 330 python3 tools/bench_grpo.py --gguf /root/smol/SmolLM2-135M-Instruct.Q4_1.gguf \
    --dataset /root/math_train.json --modes s3r,trl,trl-paged --max-steps 5 --per-device-batch 32 --num-generations 8 \
    --max-completion-length 512 --max-seconds-per-mode 70 --mode-timeout 100 --s3r-config '{"cuda_graphs": true}' \
    --json "$OUT/grpo.json" "${@:2}" 2>&1 | grep -v -i warn | tee "$OUT/grpo.log" | tail -60
  ;;
esac
log done
