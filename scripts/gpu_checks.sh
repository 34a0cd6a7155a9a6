#!/usr/bin/env bash
# What a lent GPU runs, in one call: the CUDA test bodies first (the same tests CPU runs,
# their CUDA parameters), then the GPU benchmarks the issues ask for. Each step has its own
# time limit so one hang costs only that step; logs and JSON land in $OUT.
#   bash scripts/gpu_checks.sh            # on the GPU machine: every step
#   bash scripts/gpu_checks.sh tests moe  # some steps
#   DEVICE=cpu bash scripts/gpu_checks.sh # dry run of every command line here
set -u
OUT=${OUT:-/tmp/gpu_checks}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
STEPS=${*:-tests moe moe_profile moe_memory collectives trainer planner}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
LOG=$OUT/gpu_checks.log

step() {
    local name=$1 limit=$2 t0 rc
    shift 2
    case " $STEPS " in *" $name "*) ;; *) return ;; esac
    t0=$(date +%s)
    echo "=== $name: $*" | tee -a "$LOG"
    timeout "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    echo "=== $name rc=$rc $(($(date +%s) - t0)) s" | tee -a "$LOG"
}

{
    nvidia-smi -L 2>&1 || true
    $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl",
        torch.cuda.nccl.version() if torch.cuda.is_available() else None,
        torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")'
} 2>&1 | tee -a "$LOG"

if [ "$DEVICE" = cuda ]; then
    tests=(tests/moe/test_devices.py tests/test_comm_local.py tests/parallel/test_trainer_dist.py -k cuda)
else
    tests=(tests/moe/test_devices.py -k cpu)
fi
step tests 120 $PY -m pytest -q -p no:cacheprovider --timeout 110 "${tests[@]}"

# on CUDA "all" adds the GPU-sized config (d 2048, d_ff 8192, 8 experts, 16k tokens)
step moe 100 $PY -m sparta.cli bench moe-layer --engines torch --nprocs 1 --device "$DEVICE" --dtype bfloat16 \
    --config all -n 20 -J "$OUT/moe_layer.jsonl"

# where the MoE layer's step goes, by device and by host time (the dense floor beside it)
step moe_profile 60 $PY benchmarks/moe_layer.py --device "$DEVICE" --dtype bfloat16 --config "${MOE_CONFIG:-gpu}" \
    --repeats 5 --candidates dense,sparta_dropless --profile 30

step moe_memory 100 $PY benchmarks/moe_layer.py --device "$DEVICE" --dtype bfloat16 --config all --repeats 0 \
    --candidates dense,naive,sparta_dropless,sparta_cap1.25 --memory

step collectives 45 $PY -m sparta.cli bench collectives --engines torch --nprocs 1 --device "$DEVICE" \
    -b 4K -e 256M -n 20 -J "$OUT/collectives.jsonl"

step trainer 60 $PY -m sparta.cli bench trainer --engines torch --nprocs 1 --device "$DEVICE" \
    --models dense,moe --layouts 1 --candidates eager,sparta -n 10 -J "$OUT/trainer.jsonl"

# one GPU: world 1, so the plans differ in micro-batches and recomputation only
step planner 150 $PY benchmarks/planner.py --world 1 --device "$DEVICE" --models "${PLAN_MODELS:-moe}" --plans 3 \
    --steps 8 --d-model "${PLAN_WIDTH:-1024}" --seq-len "${PLAN_SEQ:-512}" --memory 60
