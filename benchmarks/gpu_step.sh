#!/usr/bin/env bash
# The GPU session's one command (issue 36: measure against the floor, in one run): on one H200,
# within BUDGET seconds (default 530, under 9 minutes), the JSON of
#   gpu_h200_base.json      git-rsclip-base zero2 / zero1 / zero3 (no AC), the plain PyTorch twin of
#                           the step eager and compiled, our compile variant; ours / twin beside MFU
#   gpu_h200_census.json    the op census (benchmarks/census.py): ours per profile against the twin
#   gpu_h200_large.json     git-rsclip-large zero2 and its eager twin
#   gpu_h200_openclip.json  open_clip's trainer (amp_bf16, the kit's wheels) against rsclip-ds train
# into OUT_DIR (with gpu_step.log), each part started only with the time it needs left, the last
# two cut short first.
#
#   bash ../shared/gpu/kit.sh                                   # here, once: .gpu/ (carry it along)
#   source .gpu/env.sh && bash benchmarks/gpu_step.sh "$OUT"    # the GPU host: ~8.5 minutes
#   MODEL=tiny bash benchmarks/gpu_step.sh /tmp/gpu_step        # CPU, tiny: 3.5 min (6 with a cold
#                                                               # inductor cache: 2 compiled cases)
#
# Costs on the H200 host (../shared/gpu/README.md): a benchmarks.gpu case 36-80 s (start-up,
# model build ~10 s, engine, warm-up, timed steps); compiling (our variant, the compiled twin)
# adds its compile time to the warm-up. Each part's JSON is written when the part ends; a part
# cut short keeps the rows it has (benchmarks.gpu --total-budget records skipped cases,
# --open-clip leaves gpu_h200_openclip.partial.json), and a failed part does not stop the next.
# Render the committed JSON: cp OUT_DIR/gpu_h200*.json benchmarks/results/ &&
# python -m benchmarks.render_results (docs/benchmarks/gpu.md).
set -uo pipefail   # no -e: a part that fails leaves its rows and the next part runs

OUT_DIR=${1:-${OUT:?usage: bash benchmarks/gpu_step.sh OUT_DIR}}
BUDGET=${BUDGET:-530}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
exec > >(tee -a "$OUT_DIR/gpu_step.log") 2>&1   # the whole log beside the JSON
start=$SECONDS
left() { echo $((BUDGET - (SECONDS - start))); }
said() { echo "== gpu_step $(($SECONDS - start))s: $*"; }

if [ "${MODEL:-}" = tiny ]; then   # the CPU form: every part on the tiny preset, short timings
  BASE=tiny LARGE=tiny CENSUS=(--model tiny --micro 2) TIMING=(--warmup 2 --seconds 1 --max-steps 3)
  OPENCLIP=(--openclip-steps 8 --loader-workers 1)
else
  # warm-up 2: the compiled cases compile there; 5 s timed: 20-35 base steps, ~10 large steps
  BASE=git-rsclip-base LARGE=git-rsclip-large CENSUS=() TIMING=(--warmup 2 --seconds 5 --max-steps 50)
  # 20 steps of 256 (5,120 JPEGs at 224 px, ~30 s to write), rates over steps 6..20; 12 workers
  # each, as the H200 comparison in ../shared/gpu/README.md
  OPENCLIP=(--openclip-steps 20 --loader-workers 12)
fi

# What the later parts need (s): census ~80 (4 processes of ~20 s), large ~130 (zero2 ~70, twin ~55).
# The grid gets the rest: ~300 s for 6 cases (3 profiles ~35 s each, eager twin ~25 s, compiled
# twin and our compile variant ~75 s each).
CENSUS_S=90 LARGE_S=130 OPENCLIP_MIN_S=100

grid_s=$(( $(left) - CENSUS_S - LARGE_S ))
said "grid: $BASE zero2 zero1 zero3, twins eager compiled, compile variant (${grid_s}s)"
"$PY" -m benchmarks.gpu --model "$BASE" --profiles zero2 zero1 zero3 --ac off --variants base compile \
  --twins eager compiled "${TIMING[@]}" --case-timeout 180 --total-budget "$grid_s" \
  --out "$OUT_DIR/gpu_h200_base.json"
grid_rc=$?

census_s=$(( $(left) - LARGE_S ))
census_rc=skipped
if [ "$census_s" -lt 30 ]; then
  said "census: skipped, ${census_s}s before the large part's share"
else
  said "census: twin, zero1, zero2, zero3 (${census_s}s)"
  # timeout signals the census's whole process group: its subjects' processes stop with it
  timeout "$census_s" "$PY" -m benchmarks.census "${CENSUS[@]}" --timeout 120 --out "$OUT_DIR/gpu_h200_census.json"
  census_rc=$?
fi

said "large: $LARGE zero2, twin eager ($(left)s)"
"$PY" -m benchmarks.gpu --model "$LARGE" --profiles zero2 --ac off --variants base --twins eager "${TIMING[@]}" \
  --case-timeout 150 --total-budget "$(left)" --out "$OUT_DIR/gpu_h200_large.json"
large_rc=$?

openclip_rc=skipped
if [ -z "${OPENCLIP_PYTHONPATH:-}" ]; then
  said "open_clip: skipped, no OPENCLIP_PYTHONPATH (source .gpu/env.sh)"
elif [ "$(left)" -lt "$OPENCLIP_MIN_S" ]; then
  said "open_clip: skipped, $(left)s left of $BUDGET (it needs ~${OPENCLIP_MIN_S}s)"
else
  said "open_clip: amp_bf16 against rsclip-ds train zero2 bf16, $BASE ($(left)s)"
  # SIGTERM at the deadline: the run under way stops, the runs done stay in the .partial.json
  timeout "$(left)" "$PY" -m benchmarks.gpu --open-clip kit --model "$BASE" --openclip-precisions amp_bf16 \
    --openclip-peers "${OPENCLIP[@]}" --case-timeout 120 --out "$OUT_DIR/gpu_h200_openclip.json"
  openclip_rc=$?
fi

said "done: grid rc $grid_rc, census rc $census_rc, large rc $large_rc, open_clip rc $openclip_rc"
ls -l "$OUT_DIR"
