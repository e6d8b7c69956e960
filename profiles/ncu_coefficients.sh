#!/usr/bin/env bash
# Nsight Compute on the coefficients kernel (clocks left alone), with the warp-stall samples per
# SASS instruction: reports under profiles/reports/, a summary per run under profiles/
# (<gpu>-coefficients-<variant>-H<h>-rows<r>.txt), the per-instruction table (*-sass.csv) and its
# sums by stall reason and opcode (profiles/<gpu>-coefficients-...-stalls.txt, profiles/sass_stalls.py).
#   H=7168 ROWS="1 16 512" PYTHON=python3 bash profiles/ncu_coefficients.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
H=${H:-7168}
ROWS=${ROWS:-1 16 512}
VARIANTS=${VARIANTS:-standard}
REPORTS=${NCU_REPORTS:-profiles/reports}
mkdir -p "$REPORTS"
gpu=$($PY -c "import torch,re;print(re.sub('[^a-z0-9]+','-',torch.cuda.get_device_name().lower()).strip('-'))")
sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy
          --section SchedulerStats --section WarpStateStats)
for variant in $VARIANTS; do
  for rows in $ROWS; do
    name="coefficients-$variant-H$H-rows$rows"
    rep="$REPORTS/$gpu-$name"
    echo "== $name" >&2
    ncu --clock-control none --profile-from-start off --launch-count 1 --set full --import-source no -f -o "$rep" \
        "$PY" profiles/run_kernel.py --kernel coefficients --variant "$variant" --hidden "$H" --rows "$rows" >&2
    ncu --import "$rep.ncu-rep" --print-units base "${sections[@]}" > "profiles/$gpu-$name.txt"
    ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$REPORTS/$gpu-$name-sass.csv" || true
    "$PY" profiles/sass_stalls.py "$REPORTS/$gpu-$name-sass.csv" > "profiles/$gpu-$name-stalls.txt" || true
    grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Grid Size|Warp Cycles Per Issued" \
        "profiles/$gpu-$name.txt" | sed "s/^/  /" >&2
  done
done
