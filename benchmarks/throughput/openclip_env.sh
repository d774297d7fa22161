#!/usr/bin/env bash
# An isolated environment for open_clip's own trainer (open_clip_train), for the open_clip column
# of the throughput benchmark (docs/benchmarks/throughput.md, "Against open_clip"):
#
#   bash benchmarks/throughput/openclip_env.sh runs/openclip-venv        (~1 minute; 1.4 GB)
#   OPENCLIP_SYSTEM_TORCH=1 bash benchmarks/throughput/openclip_env.sh VENV   (a GPU host: its own CUDA torch)
#   python -m benchmarks.throughput.openclip --open-clip runs/openclip-venv --out benchmarks/results/throughput_openclip.json
#
# Why a venv of its own: open-clip-torch[training] pins webdataset<=0.2.86, rsclip_ds needs >=1.0.2.
# The same torch as rsclip_ds's (2.13.0, CPU build) so both sides run the same kernels.
#
# Two documented patches to installed files, each checked (the script fails if a pattern is not
# found exactly as many times as expected):
#  1. torchvision. PyPI's only x86_64 Linux wheel of torchvision 0.28.0 (the release for torch
#     2.13) is the CUDA build: its compiled ops link libtorch_cuda.so and do not load next to the
#     CPU torch, and then `import torchvision` fails at two fake-kernel registrations
#     (`@torch.library.register_fake("torchvision::nms")` and `::qnms`) that, unlike the rest of
#     _meta_registrations.py, do not check torchvision.extension._has_ops(). The patch adds that
#     check to those two lines. open_clip and timm use torchvision's PIL transforms (pure Python);
#     torchvision.ops' compiled kernels (nms, roi_align) stay unavailable.
#  2. open_clip_train/main.py wraps the model in DistributedDataParallel(model,
#     device_ids=[device]) whatever the device; torch 2.13 rejects that for a CPU module
#     (ValueError: "DistributedDataParallel device_ids and output_device arguments only work with
#     single-device/multiple-device GPU modules or CPU modules, but got device_ids
#     [device(type='cpu')]"). The patch passes device_ids=None on CPU, as DDP's documentation asks
#     for CPU modules; on a GPU the call is unchanged.
set -euo pipefail

VENV=${1:?usage: bash benchmarks/throughput/openclip_env.sh VENV_DIR}
PY=${PYTHON:-python3}
OPEN_CLIP=3.3.0       # newest on PyPI when tested
TORCH=2.13.0          # rsclip_ds's torch; resolves to the CPU wheel here
TORCHVISION=0.28.0    # the torchvision release for torch 2.13
WEBDATASET=0.2.86     # the newest open-clip-torch[training] allows
TIMM=1.0.31           # newest when tested

PIP=("$VENV/bin/python" -m pip install --quiet)
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
SYSTEM_TORCH=${OPENCLIP_SYSTEM_TORCH:-0}
if [ "$SYSTEM_TORCH" = 1 ]; then
  # A GPU host: the torch (CUDA build) and matching torchvision of $PY's environment, seen through
  # --system-site-packages and pinned there; the venv's own webdataset 0.2.86 shadows the system's.
  # Offline hosts: PIP_NO_INDEX=1 PIP_FIND_LINKS=<a folder of the wheels> (docs/benchmarks/throughput.md).
  "$PY" -c 'import torch, torchvision' || {
    echo "OPENCLIP_SYSTEM_TORCH=1: torch and torchvision must import in $PY's environment" >&2; exit 1; }
  "$PY" -m venv --system-site-packages "$VENV"
  "$VENV/bin/python" -c 'import torch, torchvision; print(f"torch=={torch.__version__}\ntorchvision=={torchvision.__version__}")' \
    > "$CONSTRAINTS"
else
  "$PY" -m venv "$VENV"
  printf 'torch==%s\ntorchvision==%s\n' "$TORCH" "$TORCHVISION" > "$CONSTRAINTS"
  "${PIP[@]}" "torch==$TORCH"
  # --no-deps: its only requirement is torch==2.13.0, installed above; nothing may swap the torch
  "${PIP[@]}" --no-deps "torchvision==$TORCHVISION"
fi
"${PIP[@]}" -c "$CONSTRAINTS" "open-clip-torch[training]==$OPEN_CLIP" "timm==$TIMM" "webdataset==$WEBDATASET"

SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# patch_file FILE COUNT SED_EXPR: apply, then check the pattern's result appears COUNT times
patch_file() {
  local file=$1 count=$2 expr=$3 marker=$4
  if [ "$(grep -c -F "$marker" "$file")" = "$count" ]; then
    echo "already patched: $file"
    return
  fi
  sed -i -E "$expr" "$file"
  local got
  got=$(grep -c -F "$marker" "$file" || true)
  if [ "$got" != "$count" ]; then
    echo "patch of $file applied $got times, expected $count: the pinned versions changed?" >&2
    exit 1
  fi
  echo "patched: $file ($count lines)"
}

[ "$SYSTEM_TORCH" = 1 ] || patch_file "$SITE/torchvision/_meta_registrations.py" 2 \
  's/^@torch\.library\.register_fake\(("torchvision::q?nms")\)$/@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda fn: fn))/' \
  'if torchvision.extension._has_ops() else (lambda fn: fn))'
patch_file "$SITE/open_clip_train/main.py" 2 \
  's/DistributedDataParallel\(([a-z_]+), device_ids=\[device\], \*\*ddp_args\)/DistributedDataParallel(\1, device_ids=None if device.type == "cpu" else [device], **ddp_args)/' \
  'device_ids=None if device.type == "cpu" else [device]'

"$VENV/bin/python" - <<'EOF'
import open_clip, open_clip_train.main, timm, torch, torchvision, webdataset
print(f"open_clip {open_clip.__version__}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"timm {timm.__version__}, webdataset {webdataset.__version__}")
EOF
echo "open_clip environment ready: $VENV"
