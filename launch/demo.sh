#!/usr/bin/env bash
# The README's first command ends here: synthetic shards -> tokenizer -> a 2-rank training run
# with the deepspeed launcher (CPU ranks without a GPU, GPUs where there are some).
#   bash launch/demo.sh [extra --set overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=data/synthetic
if [ ! -f "$DATA/eval/captions.json" ]; then   # --eval: the val split also as class folders + caption JSON
  rsclip-ds make-synthetic --out "$DATA" --num-train 4096 --num-val 512 --shard-size 512 --image-size 64 --eval
fi
if [ ! -f "$DATA/tokenizer/tokenizer.json" ]; then
  rsclip-ds train-tokenizer --shards "$DATA/train-{000000..000007}.tar" --out "$DATA/tokenizer" --vocab-size 1000 --max-length 64
fi
NGPUS=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPUS" -ge 1 ]; then
  NPROC=$(( NGPUS >= 2 ? 2 : 1 ))
else
  export DS_ACCELERATOR=cpu   # no GPU: 2 CPU ranks talking over gloo
  NPROC=2
fi
# checkpoint.overwrite: a second demo run starts afresh and moves the first one's checkpoints aside
exec deepspeed --num_gpus "$NPROC" --module rsclip_ds train --config configs/tiny_demo.yaml \
  --set checkpoint.overwrite=true --set eval.every=50 --set eval.zero_shot_dir="$DATA/eval/classes" \
  --set eval.retrieval_json="$DATA/eval/captions.json" "$@"
