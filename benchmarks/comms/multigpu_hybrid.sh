#!/usr/bin/env bash
# zero3 against the hybrid-sharding profiles (zero3_hpz, zero3_zeropp) on one machine with N GPUs,
# through the launcher as a cluster runs it: throughput and loss parity, one JSON.
#
#   bash benchmarks/comms/multigpu_hybrid.sh --gpus 8 --out benchmarks/results/multigpu_hybrid_h100x8.json
#       [--nodes 2] [--model git-rsclip-base] [--micro 64] [--steps 40] [--precision bf16]
#       [--profiles "zero3 zero3_hpz zero3_zeropp"] [--work runs/multigpu_hybrid]
#
# --nodes 2 (the default) splits the GPUs into 2 "nodes" of N/2 (a hostfile, one launcher per
# node with --no-ssh, --include giving each its own GPUs: node-0:0..N/2-1@node-1:N/2..N-1), so
# hpZ's per-node group is N/2 GPUs and qgZ's inter-node stage runs (DeepSpeed counts nodes as
# world / visible GPUs). --nodes 1: one node; hpZ's group is then every GPU (zero3 plus a copy)
# and qgZ never leaves the node: only the kernels are exercised.
# Each profile trains the same steps from the same seed on the same synthetic shards (written
# once under --work, with a tokenizer), `rsclip-ds train` via launch/cluster.sh; the report takes
# samples/s and the per-step losses from each run's summary.json and compares the losses with
# zero3's: hpZ must match to --hpz-rtol (its secondary shard is a copy: equal bit for bit on CPU
# ranks, tests/integration/test_hybrid_sharding.py; GPU kernels may reorder sums), zeropp to
# --zeropp-rtol (int8 weights, int4 gradients: close, not equal). Exit 0 when every run finished
# and every comparison passed.
#
# CPU smoke test (CPU ranks stand in for GPUs; zero3_zeropp is refused there: CUDA only), ~3 min:
#   DS_ACCELERATOR=cpu bash benchmarks/comms/multigpu_hybrid.sh --gpus 2 --model tiny --micro 8 --steps 4 \
#       --precision fp32 --profiles "zero3 zero3_hpz" --out /tmp/hybrid_smoke.json
set -euo pipefail
cd "$(dirname "$0")/../.."

die() { echo "multigpu_hybrid.sh: $*" >&2; exit 2; }
gpus="" nodes=2 model=git-rsclip-base micro=64 steps=40 precision=bf16 out="" work=runs/multigpu_hybrid
profiles="zero3 zero3_hpz zero3_zeropp" hpz_rtol=1e-3 zeropp_rtol=0.05 px=256 images=4096
while [ $# -gt 0 ]; do
  case "$1" in
    --gpus) gpus="$2"; shift 2 ;;
    --nodes) nodes="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --micro) micro="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --precision) precision="$2"; shift 2 ;;
    --profiles) profiles="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --work) work="$2"; shift 2 ;;
    --hpz-rtol) hpz_rtol="$2"; shift 2 ;;
    --zeropp-rtol) zeropp_rtol="$2"; shift 2 ;;
    --px) px="$2"; shift 2 ;;
    --images) images="$2"; shift 2 ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[ -n "$out" ] || die "--out is required (the JSON report)"
if [ -z "$gpus" ]; then
  gpus=$(python -c "import torch; print(torch.cuda.device_count())")
fi
[ "$gpus" -ge 1 ] || die "no GPUs (--gpus N; with DS_ACCELERATOR=cpu, N CPU ranks)"
[ $(( gpus % nodes )) -eq 0 ] || die "--gpus $gpus is not a multiple of --nodes $nodes"
[ $(( gpus / nodes )) -ge 1 ] || die "--nodes $nodes leaves no GPU per node"
per_node=$(( gpus / nodes ))

# 64 images per shard: enough shards for every rank (the loader refuses fewer shards than ranks)
data="$work/data_${images}x${px}" shard=64
shards="$data/train-{000000..$(printf '%06d' $(( (images + shard - 1) / shard - 1 )))}.tar"
if [ ! -f "$data/tokenizer/tokenizer.json" ]; then
  rsclip-ds make-synthetic --out "$data" --num-train "$images" --num-val 16 --shard-size "$shard" --image-size "$px"
  rsclip-ds train-tokenizer --shards "$shards" --out "$data/tokenizer" --vocab-size 1000 --max-length 64
fi

# the hostfile and --include: every "node" is this machine (slots = all its GPUs); --include gives
# node i GPUs i*per_node .. (i+1)*per_node-1 (the launcher sets CUDA_VISIBLE_DEVICES and LOCAL_SIZE)
mkdir -p "$work"
hostfile="$work/hostfile" include=""
: > "$hostfile"
for ((i = 0; i < nodes; i++)); do
  echo "node-$i slots=$gpus" >> "$hostfile"
  ids=$(seq -s, $(( i * per_node )) $(( (i + 1) * per_node - 1 )))
  include="${include:+$include@}node-$i:$ids"
done

run_profile() {   # $1 = profile -> $work/$1/summary.json (or its log on failure)
  local profile="$1" port
  port=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  rm -rf "${work:?}/$profile"; mkdir -p "$work/$profile"
  local sets=(--set "steps=$steps" --set "seed=0" --set "precision=$precision" --set "model.preset=$model"
              --set "model.tokenizer=$data/tokenizer" --set "data.train_shards=$shards"
              --set "batch.micro_batch_size=$micro" --set "optim.warmup_steps=2" --set "logging.log_every=1"
              --set "logging.progress=plain" --set "checkpoint.at_end=false" --set "output_dir=$work/$profile/run")
  local pids=()
  for ((r = 0; r < nodes; r++)); do
    bash launch/cluster.sh --hostfile "$hostfile" --include "$include" --no-ssh --node-rank "$r" \
      --master-addr 127.0.0.1 --master-port "$port" --config configs/tiny_demo.yaml --profile "$profile" \
      "${sets[@]}" > "$work/$profile/node$r.log" 2>&1 &
    pids+=($!)
  done
  local code=0
  for pid in "${pids[@]}"; do wait "$pid" || code=$?; done
  echo "$code" > "$work/$profile/exit_code"
  echo "multigpu_hybrid.sh: $profile exit $code" >&2
}

for profile in $profiles; do run_profile "$profile"; done

python - "$out" "$work" "$gpus" "$nodes" "$model" "$micro" "$steps" "$precision" "$hpz_rtol" "$zeropp_rtol" $profiles <<'EOF'
import json, sys
from pathlib import Path

out, work, gpus, nodes, model, micro, steps, precision, hpz_rtol, zeropp_rtol, *profiles = sys.argv[1:]
work, rtol = Path(work), {"zero3_hpz": float(hpz_rtol), "zero3_zeropp": float(zeropp_rtol)}
runs = {}
for p in profiles:
    summary = work / p / "run" / "summary.json"
    code = int((work / p / "exit_code").read_text())
    if code != 0 or not summary.is_file():
        log = (work / p / "node0.log").read_text()[-3000:] if (work / p / "node0.log").is_file() else ""
        runs[p] = {"ok": False, "exit_code": code, "log_tail": log}
        continue
    s = json.loads(summary.read_text())
    runs[p] = {"ok": True, "samples_per_s": s["samples_per_s"], "losses": s["losses"],
               "world_size": s["world_size"], "zero_stage": s.get("zero_stage")}
ref = runs.get("zero3", {})
for p, r in runs.items():
    if p == "zero3" or not (r["ok"] and ref.get("ok")):
        continue
    rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
    r.update(speedup_vs_zero3=r["samples_per_s"] / ref["samples_per_s"], max_rel_loss_diff_vs_zero3=rel,
             loss_rtol=rtol.get(p), loss_parity=rel <= rtol.get(p, 0.0))
report = {"config": {"gpus": int(gpus), "nodes": int(nodes), "gpus_per_node": int(gpus) // int(nodes),
                     "model": model, "micro": int(micro), "steps": int(steps), "precision": precision},
          "runs": runs}
Path(out).parent.mkdir(parents=True, exist_ok=True)
Path(out).write_text(json.dumps(report, indent=2))
for p, r in runs.items():
    line = (f"{r['samples_per_s']:.1f} samples/s, final loss {r['losses'][-1]:.4f}" if r["ok"]
            else f"FAILED (exit {r['exit_code']})")
    if "loss_parity" in r:
        line += (f", x{r['speedup_vs_zero3']:.2f} vs zero3, max rel loss diff {r['max_rel_loss_diff_vs_zero3']:.2e}"
                 f" ({'ok' if r['loss_parity'] else 'ABOVE'} rtol {r['loss_rtol']})")
    print(f"{p}: {line}")
print(f"wrote {out}")
sys.exit(0 if all(r["ok"] and r.get("loss_parity", True) for r in runs.values()) else 1)
EOF
