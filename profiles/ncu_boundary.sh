#!/usr/bin/env bash
# Nsight Compute on the fused boundary kernel at 16 and 512 rows (and the coefficients kernel at 1
# and 512 rows), clocks left alone. Saves the reports under profiles/reports/ and a short summary
# per run under profiles/ (<gpu>-<kernel>-H<h>-rows<r>.txt).
#   H=7168 PYTHON=python3 bash profiles/ncu_boundary.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
H=${H:-7168}
REPORTS=${NCU_REPORTS:-profiles/reports}
mkdir -p "$REPORTS"
gpu=$($PY -c "import torch,re;print(re.sub('[^a-z0-9]+','-',torch.cuda.get_device_name().lower()).strip('-'))")
sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy --section WarpStateStats)

profile() {  # name, then the arguments of profiles/run_kernel.py
  local name=$1; shift
  local rep="$REPORTS/$gpu-$name"
  echo "== $name" >&2
  ncu --clock-control none --profile-from-start off --launch-count 1 --set full -f -o "$rep" \
      "$PY" profiles/run_kernel.py "$@" >&2
  ncu --import "$rep.ncu-rep" --print-units base "${sections[@]}" > "profiles/$gpu-$name.txt"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Grid Size|Block Size|Cluster Size" \
      "profiles/$gpu-$name.txt" | sed "s/^/  /" >&2
}

for rows in 16 512; do
  profile "boundary-H$H-rows$rows" --kernel boundary --hidden "$H" --rows "$rows"
done
profile "boundary-mxfp8-H$H-rows16" --kernel boundary --hidden "$H" --rows 16 --mxfp8
for rows in 1 512; do
  profile "coefficients-H$H-rows$rows" --kernel coefficients --hidden "$H" --rows "$rows"
done
