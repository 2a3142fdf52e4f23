#!/usr/bin/env bash
# Issue 44's device run: everything a lent GPU is asked for, in one call of about 9 minutes with a
# hard limit, the answers that matter most first, so that a run cut short has still answered them:
#   1. Llama-3-8B's shapes under fsdp and FSDP2 at a fake world of 64: peak memory against the planner
#      (fsdp frees its gathered root before the root's reduce-scatter since the third run: ours against FSDP2);
#   2. gpt-2-124m, bf16: every strategy at world 1, 20 steps against single, and MFU eager and compiled;
#   3. the same at 4 times the micro-batch: the host launches the same kernels for 4 times the work
#      (every step is bound by the host at micro-batch 8);
#   4. what the peak of 1 is made of, beside the planner's moments (bench/gpu_profile.py --memory);
#   5. the CUDA tests (tests/gpu): every strategy at world 1 through `shardwise train` against single,
#      compiled against eager, a resume from asynchronous checkpoints, fsdp at a fake 8 against the planner
#      (all 9 took 198 s in the third run);
#   6. the sharded strategies as rank 0 of a fake world of 8, against single's step;
#   7. what time is left: the fake world of 64, gpu-scale's other jobs and its longest sequence.
# Each stage writes its JSON to OUT as it ends and appends its output to OUT/log.txt; a stage gets
# what is left of the limit at most, and is skipped when under a minute is left.
#
#   bash bench/gpu_run.sh OUT [SECONDS=540]
# Without CUDA it runs the same stages on tiny models as a harness check (no device figures).
set -u
OUT=${1:?usage: bash bench/gpu_run.sh OUT [SECONDS]}
LIMIT=${2:-540}
mkdir -p "$OUT"
START=$(date +%s)
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    GPT=gpt2-124m MB=8 STEPS=20 LLAMA=configs/llama-3-8b.toml SEQ=4096
else
    GPT=tiny MB=2 STEPS=4 LLAMA=$OUT/llama-tiny.toml SEQ=64
    printf '[model]\nname = "hf-llama"\nn_layer = 2\nn_head = 8\nn_kv_head = 8\nd_model = 64\nd_ff = 128\n'`
         `'seq_len = 64\nvocab_size = 256\n\n[data]\nname = "synthetic-tokens"\n' > "$LLAMA"
fi

stage() {  # stage NAME SECONDS COMMAND...: run COMMAND under the smaller of SECONDS and what is left
    local name=$1 budget=$2 left
    shift 2
    left=$((LIMIT - ($(date +%s) - START)))
    ((budget > left)) && budget=$left
    if ((budget < 60)); then
        echo "== $name: skipped, $left s left" | tee -a "$OUT/log.txt"
        return
    fi
    echo "== $name (at most $budget s; $(($(date +%s) - START)) s in)" | tee -a "$OUT/log.txt"
    timeout -k 10 "$budget" "$@" >>"$OUT/log.txt" 2>&1
    echo "== $name: exit $? after $(($(date +%s) - START)) s" | tee -a "$OUT/log.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv 2>&1
  python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.is_available())'; } >>"$OUT/log.txt" 2>&1
stage llama-64 120 python3 -m bench.gpu_scale --config "$LLAMA" --steps 3 --no-longest \
    --job "fsdp:64:blocks:$SEQ" --job "fsdp-native:64:blocks:$SEQ" --json "$OUT/gpu-scale-64.json"
stage world-1 150 python3 -m bench.gpu --worlds 1 --steps "$STEPS" --preset "$GPT" --micro-batch "$MB" \
    --json "$OUT/gpu-world-1.json"
stage world-1-batch 120 python3 -m bench.gpu --worlds 1 --steps "$STEPS" --preset "$GPT" --micro-batch $((4 * MB)) \
    --json "$OUT/gpu-world-1-batch.json"
stage memory-llama 90 python3 -m bench.gpu_profile --memory --scale-job "fsdp:64:blocks:$SEQ" --scale-config "$LLAMA" \
    --json "$OUT/memory-llama-64.json"
stage tests 220 python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/gpu
stage fake-8 90 python3 -m bench.gpu --worlds 8 --steps 10 --preset "$GPT" --micro-batch "$MB" \
    --json "$OUT/gpu-fake-8.json"
stage fake-64 90 python3 -m bench.gpu --worlds 64 --steps 10 --preset "$GPT" --micro-batch "$MB" \
    --json "$OUT/gpu-fake-64.json"
stage gpu-scale 600 python3 -m bench.gpu_scale --config "$LLAMA" --steps 3 --json "$OUT/gpu-scale.json"
tail -n 60 "$OUT/log.txt"
