#!/usr/bin/env bash
# P26 (GPU screen): every pilot of docs/testbed-pilots/README.md "P26" on one GPU, several at a time.
# Run on the device machine from the repository root with the carried wheels installed; results to $OUT.
set -u
OUT=${OUT:-/tmp/p26}; W=/tmp/p26w; mkdir -p "$OUT" $W/pre $W/logs
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
# P26_DRY=1: the same script at a few steps on the CPU (to check it before a GPU is spent on it)
if [ "${P26_DRY:-0}" = 1 ]; then N="60 40 40 16 256"; STEPS="8 2 8 2"; DEV=cpu
else N="4000 300 500 256 24000"; STEPS="2000 50 250 25"; DEV=cuda; fi
read -r NTR NTE NPR NAG NPT <<<"$N"; read -r PS PW FS FW <<<"$STEPS"
COMMON="--threads 1 --device $DEV --norm-mismatch-task symbols --norm-mismatch-lr-multiplier 10"
for kv in suite.task_set=headroom8 suite.n_train=$NTR suite.n_test=$NTE suite.n_probe=$NPR suite.n_agnostic=$NAG \
          suite.n_pretrain=$NPT suite.caption_rate=0.5 pretrain.arch=mergecal-vit-small-p8 pretrain.steps=$PS \
          pretrain.warmup_steps=$PW pretrain.lr=0.001 finetune.steps=$FS finetune.warmup_steps=$FW; do
  COMMON="$COMMON --set $kv"; done
# the two suites first (the pilots read them; building one per pilot would race)
for s in 0 1; do
  python3 - "$s" "$N" "$W" <<'PY' &
import sys; sys.path.insert(0, ".")
from mergecal.data.vision import SuiteConfig, build_vision_suite
s = int(sys.argv[1])
ntr, nte, npr, nag, npt = map(int, sys.argv[2].split())
build_vision_suite(f"{sys.argv[3]}/suite{s}", SuiteConfig(task_set="headroom8", n_train=ntr, n_test=nte, n_probe=npr,
                   n_agnostic=nag, n_pretrain=npt, caption_rate=0.5, seed=s), progress=False)
PY
done
wait; echo "suites built: $SECONDS s"
pilot() {  # name seed extra-args...
  local name=$1 s=$2; shift 2
  python3 scripts/pilot_vision.py $COMMON --root $W/suite$s --set suite.seed=$s --set pretrain.seed=$s \
    --set finetune.seed=$s --json $W/logs/$name-seed$s.json "$@" > $W/logs/$name-seed$s.log 2>&1
  echo "$name seed $s rc $? at $SECONDS s"
}
PIDS=()
if [ "${P26_ROUND:-1}" = 1 ]; then
for s in 0 1; do
  # A: P25's recipe (learned temperature) -> B: its model with the heads at CLIP's 100, fine-tunes at lr 3e-4
  (pilot A-small $s --pretrained $W/pre/small$s.safetensors --set finetune.lr=0.001
   pilot B-small-t100-lr3e-4 $s --pretrained $W/pre/small$s.safetensors --logit-scale 100 --set finetune.lr=0.0003) & PIDS+=($!)
  # C: pretraining started at temperature 100 (learned, clamped at 100) -> D: the same model, fine-tunes at 3e-4
  (pilot C-small-init100 $s --pretrained $W/pre/small100-$s.safetensors --init-logit-scale 100 --set finetune.lr=0.001
   pilot D-small-init100-lr3e-4 $s --pretrained $W/pre/small100-$s.safetensors --set finetune.lr=0.0003) & PIDS+=($!)
  # E, F: the tiny tower (the default's) on headroom8, learned temperature / started at 100
  (pilot E-tiny $s --set pretrain.arch=mergecal-vit-tiny-p8 --set finetune.lr=0.001) & PIDS+=($!)
  (pilot F-tiny-init100 $s --set pretrain.arch=mergecal-vit-tiny-p8 --init-logit-scale 100 --set finetune.lr=0.001) & PIDS+=($!)
done
else  # round 2: P25's recipe with longer fine-tunes (the standard models' confidence)
for s in 0 1; do
  (pilot G-small-ft500 $s --set finetune.lr=0.001 --set finetune.steps=500 --set finetune.warmup_steps=50) & PIDS+=($!)
  (pilot H-small-ft1000 $s --set finetune.lr=0.001 --set finetune.steps=1000 --set finetune.warmup_steps=100) & PIDS+=($!)
done
fi
# E and F's --set pretrain.arch overrides COMMON's small tower (the pilot applies --set in order).
# What is done so far comes back even if the call is stopped at its limit: the logs, re-packed every 20 s.
( while sleep 20; do tar czf $OUT/.p26.tgz -C $W logs && mv $OUT/.p26.tgz $OUT/p26.tgz; done ) &
TARPID=$!
wait "${PIDS[@]}"
kill $TARPID; tar czf $OUT/p26.tgz -C $W logs; echo "all done: $SECONDS s"
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true
