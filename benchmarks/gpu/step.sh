#!/usr/bin/env bash
# The GPU session's one command (issue 44: ddp / zero2 x amp_bf16 / bf16 against the floor, and the
# planner's pick against open_clip): on one H100 or H200, within BUDGET seconds (default 530, under
# 9 minutes), these parts in this order, the most valuable first, each started only with the time
# it needs left, each writing its JSON into OUT_DIR as it ends (DEV: h100 / h200 from the device's
# name; cpu in the CPU form):
#   base      gpu_DEV_base.json       git-rsclip-base ddp/amp_bf16 against the plain PyTorch twin
#                                     eager and compiled (ours / twin beside MFU)          est. ~135 s
#   openclip  gpu_DEV_openclip.json   `rsclip-ds train` with the planner's pick for this GPU (ddp,
#                                     amp_bf16, micro 256 for base on 80 / 141 GB) against open_clip's
#                                     trainer (amp_bf16, the kit's wheels) on the same shards  ~115 s
#   zero      gpu_DEV_base.json       + git-rsclip-base zero2/amp_bf16 and zero2/bf16, appended to
#                                     base's report: read against the same twins            ~70 s
#   large     gpu_DEV_large.json      git-rsclip-large ddp/amp_bf16, twin eager and compiled, zero2/bf16,
#                                     zero2/amp_bf16, in that order, with what is left     (~345 s)
#   census    gpu_DEV_census_ddp.json, gpu_DEV_census_zero.json  the op census (benchmarks/census.py)
#                                     of ddp/amp_bf16, zero1/bf16 and zero2/bf16 with their twins,
#                                     only with ~110 s left                                (~110 s)
# The estimates are from the H200 run's costs (../shared/gpu/README.md: a benchmarks.gpu case 36-80 s,
# `rsclip-ds train` to its first step ~20 s; compiling adds ~40 s): together ~780 s, so in one call of
# BUDGET=530 large gets ~200 s, its first two or three cases (the rest are recorded as skipped), and
# the census does not run; `PARTS="large census" bash benchmarks/gpu/step.sh OUT` runs those later.
#
#   bash ../shared/gpu/kit.sh                                   # here, once: .gpu/ (carry it along)
#   source .gpu/env.sh && bash benchmarks/gpu/step.sh "$OUT"    # the GPU host: ~9 minutes
#   MODEL=tiny bash benchmarks/gpu/step.sh /tmp/gpu_step        # CPU, tiny: every part but open_clip's, 3-4 min
#                                                               # on 2 cores (232 s; 164 s with inductor's cache warm)
#
# A part cut short keeps what ran: benchmarks.gpu writes OUT.partial.json after every case and records
# the cases --total-budget skipped; --open-clip leaves gpu_DEV_openclip.partial.json; a failed part does
# not stop the next. Render the committed JSON: cp OUT_DIR/gpu_h*.json benchmarks/results/ &&
# python -m benchmarks.render_results (docs/benchmarks/gpu.md). Not to commit: *.partial.json.
set -uo pipefail   # no -e: a part that fails leaves its rows and the next part runs

OUT_DIR=${1:-${OUT:?usage: bash benchmarks/gpu/step.sh OUT_DIR}}
PY=${PYTHON:-python3}
PARTS=${PARTS:-base openclip zero large census}
mkdir -p "$OUT_DIR"
exec > >(tee -a "$OUT_DIR/gpu_step.log") 2>&1   # the whole log beside the JSON
start=$SECONDS
said() { echo "== gpu_step $((SECONDS - start))s: $*"; }
want() { [[ " $PARTS " == *" $1 "* ]]; }

# What the host has, first: a kit built for another Python fails on its first import, minutes later.
said "host: $("$PY" -V 2>&1); torch $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>&1)"
command -v nvidia-smi > /dev/null && nvidia-smi -L
if ls .gpu/wheels/rs/*cp312*.whl > /dev/null 2>&1 \
    && ! "$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12)'; then
  said "stop: the kit's binary wheels (.gpu/wheels/rs) are cp312 and this host's Python is not 3.12; rebuild the kit"
  exit 3
fi
if ! "$PY" -c 'import deepspeed, pydantic, webdataset' > /dev/null 2>&1; then
  said "stop: deepspeed, pydantic or webdataset does not import: start with \`source .gpu/env.sh &&\`" \
    "(the kit: ../shared/gpu/kit.sh)"
  exit 3
fi
DEV=$("$PY" -c 'from benchmarks.gpu.peaks import device_tag; print(device_tag())' 2> /dev/null) || DEV=gpu

if [ "${MODEL:-}" = tiny ]; then   # the CPU form: every part on the tiny preset, short timings
  BUDGET=${BUDGET:-1500}   # a smoke test runs every part: nothing is skipped for time on 2 slow cores
  BASE=tiny LARGE=tiny CENSUS=(--model tiny --micro 2) TIMING=(--warmup 2 --seconds 1 --max-steps 3)
  OPENCLIP=(--openclip-steps 8 --loader-workers 1 --pick-gpu-mem 16GiB)
else
  BUDGET=${BUDGET:-530}
  # warm-up 2: the compiled cases compile there; 5 s timed: 20-35 base steps, ~10 large steps
  BASE=git-rsclip-base LARGE=git-rsclip-large CENSUS=() TIMING=(--warmup 2 --seconds 5 --max-steps 50)
  # 20 steps of the pick's micro-batch (base: 256, 5,120 JPEGs at 224 px, ~30 s to write), rates over
  # steps 6..20; 12 workers each, as the H200 comparison in ../shared/gpu/README.md; the pick plans
  # for this GPU's memory (torch.cuda)
  OPENCLIP=(--openclip-steps 20 --loader-workers 12)
fi
left() { echo $((BUDGET - (SECONDS - start))); }
# A part's share (s, the estimates above): a part starts only when its minimum is left, and an earlier
# part leaves the later parts' minimum (the parts' --total-budget): a slow base keeps open_clip's share.
OPENCLIP_S=115 ZERO_S=70 LARGE_MIN_S=60 CENSUS_DDP_S=45 CENSUS_ZERO_S=65
share() {   # seconds for part $1: what is left less the minimum of each wanted part after it
  local s=$(left) later=0 p seen=
  for p in base openclip zero large; do
    if [ -n "$seen" ] && want "$p"; then
      case $p in openclip) later=$((later + OPENCLIP_S));; zero) later=$((later + ZERO_S));;
                 large) later=$((later + LARGE_MIN_S));; esac
    fi
    [ "$p" = "$1" ] && seen=1
  done
  echo $((s - later))
}
GRID=(--ac off --variants base "${TIMING[@]}" --case-timeout 180)
rc_base=skipped rc_openclip=skipped rc_zero=skipped rc_large=skipped rc_census=skipped

if want base; then
  said "base: $BASE ddp/amp_bf16, twins eager compiled ($(share base)s)"
  "$PY" -m benchmarks.gpu --model "$BASE" --profiles ddp --precisions amp_bf16 --twins eager compiled "${GRID[@]}" \
    --total-budget "$(share base)" --out "$OUT_DIR/gpu_${DEV}_base.json"
  rc_base=$?
fi

if ! want openclip; then :
elif [ -z "${OPENCLIP_PYTHONPATH:-}" ]; then
  said "openclip: skipped, no OPENCLIP_PYTHONPATH: open_clip is not here (source .gpu/env.sh)"
elif [ "$(share openclip)" -lt "$OPENCLIP_S" ]; then
  said "openclip: skipped, $(share openclip)s left for it (it needs ~${OPENCLIP_S}s)"
else
  said "openclip: rsclip-ds train with the planner's pick against open_clip amp_bf16, $BASE ($(share openclip)s)"
  # SIGTERM at the deadline: the run under way stops, the runs done stay in the .partial.json
  timeout "$(share openclip)" "$PY" -m benchmarks.gpu --open-clip kit --planner-pick --model "$BASE" \
    --openclip-precisions amp_bf16 --openclip-peers "${OPENCLIP[@]}" --case-timeout 120 \
    --out "$OUT_DIR/gpu_${DEV}_openclip.json"
  rc_openclip=$?
fi

if want zero; then
  said "zero: $BASE zero2/amp_bf16, zero2/bf16, appended to base's report ($(share zero)s)"
  # --append: the twins of the base part's report stay beside them and are paired with these cases
  "$PY" -m benchmarks.gpu --model "$BASE" --profiles zero2 --precisions amp_bf16 bf16 --twins "${GRID[@]}" \
    --total-budget "$(share zero)" --append --out "$OUT_DIR/gpu_${DEV}_base.json"
  rc_zero=$?
fi

if ! want large; then :
elif [ "$(left)" -lt "$LARGE_MIN_S" ]; then
  said "large: skipped, $(left)s left (its first case needs ~${LARGE_MIN_S}s)"
else
  said "large: $LARGE ddp/amp_bf16, twins eager compiled, zero2/bf16, zero2/amp_bf16 ($(left)s)"
  # --precisions bf16 amp_bf16: zero2/bf16 (a ZeRO run's default) before zero2/amp_bf16; ddp/bf16 is refused
  "$PY" -m benchmarks.gpu --model "$LARGE" --profiles ddp zero2 --precisions bf16 amp_bf16 --twins eager compiled \
    "${GRID[@]}" --total-budget "$(left)" --out "$OUT_DIR/gpu_${DEV}_large.json"
  rc_large=$?
fi

if ! want census; then :
elif [ "$(left)" -lt $((CENSUS_DDP_S + CENSUS_ZERO_S)) ]; then
  said "census: skipped, $(left)s left (it needs ~$((CENSUS_DDP_S + CENSUS_ZERO_S))s: PARTS=census runs it alone)"
else
  said "census: ddp/amp_bf16, zero1/bf16, zero2/bf16 and their twins ($(left)s)"
  # timeout signals the census's whole process group: its subjects' processes stop with it
  timeout $(($(left) - CENSUS_ZERO_S)) "$PY" -m benchmarks.census "${CENSUS[@]}" --profiles ddp --precisions amp_bf16 \
    --timeout 120 --out "$OUT_DIR/gpu_${DEV}_census_ddp.json"
  rc_census=$?
  timeout "$(left)" "$PY" -m benchmarks.census "${CENSUS[@]}" --profiles zero1 zero2 --precisions bf16 \
    --timeout 120 --out "$OUT_DIR/gpu_${DEV}_census_zero.json"
  rc_census="$rc_census/$?"
fi

said "done: base rc $rc_base, openclip rc $rc_openclip, zero rc $rc_zero, large rc $rc_large, census rc $rc_census"
ls -l "$OUT_DIR"
