#!/usr/bin/env bash
# The pending H200 work of the open issues (#45, #47), in device calls: one step a call.
# Tracked so that it survives a lost checkout (the git-excluded .device/ does not).
#
#   bash .device/install.sh >/dev/null && bash bench/experiments/device_plan.sh A
#
# Each step writes its logs under $OUT/<step>/ and stops its commands at their own timeouts,
# so a call's 600 s holds the step. Order (device time is 30 min a session; keep a rerun):
#   A  #45 close-out: the host part x3 (sublayer columns), host_profile, the short GPU files
#   F  the one-launch V4 boundary: bf16 cold / warm, prefetch, MXFP8 cold, isolated, 8 clusters
#   G  the one launch in the step, and the step part's V4 column at H 7168
#   B  the multi-rank GPU files (IPC processes, late ranks, peer sanitizer)
#   E  make bench's V4 part, weights cold (TileLang's chain in its own call: step T)
#   T  TileLang's V4 chain for the same shapes (carry .device-tl; run alone)
#   D  the finish-prefetch A/B (branch wip/finish-prefetch; archive carried as .device/fp.tar)
#   C  late-rank trials (negative control included)
#   H  ncu of the V4 kernels (profile_all --only v4-final own-pre)
#   M  several GPUs (only where status lists a multi-GPU kind): NVLS off, real ranks
# Decision rules and predictions: docs/perf-log.md v43 / v44. Done 2026-12-05 (perf-log v46): A, F (the one launch:
# not shipped), B in part (cut by the call limit: run B's late-rank and multiprocess files again, then B2, T / E, G).
set -uo pipefail
step=${1:?usage: device_plan.sh STEP (A B C D E F G H M T)}
OUT=${OUT:-/tmp/out}
log=$OUT/$step
mkdir -p "$log"
export MHC_BOUNDARY_CACHE_DIR=${MHC_BOUNDARY_CACHE_DIR:-$PWD/.device/cache}
py=python3
t() {  # t SECONDS NAME CMD...: one command, its output in NAME.log, its status echoed
    local s=$1 name=$2; shift 2
    local t0=$SECONDS
    timeout -k 5 "$s" "$@" >"$log/$name.log" 2>&1
    echo "$name rc=$? $((SECONDS - t0))s"
    tail -n 4 "$log/$name.log"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader >"$log/gpu.txt" 2>&1
case $step in
A)
    t 110 host1 $py -m bench --parts host --hidden 4096 5120 7168
    t 70 host2 $py -m bench --parts host --hidden 4096 7168
    t 70 host3 $py -m bench --parts host --hidden 4096 7168
    t 60 host_profile $py -m bench.experiments.host_profile --hidden 4096 7168
    t 270 gpu_short $py -m pytest -q -m gpu -rs tests/test_native_launch.py tests/test_ops.py \
        tests/test_module_calls.py tests/test_v4_boundaries.py tests/test_boundary_own_pre.py \
        tests/test_final_boundary.py tests/test_user_errors.py
    ;;
F)
    oc="$py -m bench.experiments.v4_one_cluster"
    t 150 bf16 $oc --hidden 4096 7168 --rows 1 8 16 --variant fma exact --weights cold warm
    t 90 prefetch $oc --hidden 7168 --rows 1 16 --variant exact --weights cold --prefetch
    t 90 quant $oc --hidden 7168 --rows 1 16 --variant exact --forms mxfp8 fp8 --weights cold
    t 90 isolate $oc --hidden 4096 7168 --rows 1 16 --variant exact --weights cold --isolate
    t 90 clusters8 $oc --hidden 7168 --rows 64 --variant exact --max-clusters 8 --weights cold
    ;;
G)
    t 300 step $py -m bench.experiments.v4_one_cluster_step --hidden 7168 --rows 1 16
    t 250 step_part $py -m bench --parts step --step-hidden 7168 --step-rows 1 16 --no-compile
    ;;
B)
    t 560 gpu_ranks $py -m pytest -q -m gpu -rs tests/test_allreduce_gpu.py \
        tests/test_allreduce_multiprocess.py tests/test_late_rank_gpu.py tests/test_peer_sanitizer.py \
        tests/test_side_stream_gpu.py tests/test_scheduler.py tests/test_start_delay.py
    ;;
B2)  # the remaining GPU files
    t 560 gpu_rest $py -m pytest -q -m gpu -rs tests/test_boundary_gpu.py tests/test_boundary_kernel_gpu.py \
        tests/test_coefficients_kernel_gpu.py tests/test_early_loads.py tests/test_fp8_group_gpu.py \
        tests/test_layer_input_quant_gpu.py tests/test_own_pre_gpu.py
    ;;
E)
    # after T: copy its tilelang-v4.json and parity.pt into bench/results/tl-v4/ (untracked) before this call
    tl=(); [ -f bench/results/tl-v4/tilelang-v4.json ] && tl=(--tilelang-v4 bench/results/tl-v4)
    t 560 bench_v4 $py -m bench --parts v4 --hidden 4096 7168 --rows 1 16 128 512 "${tl[@]}" --out "$log"
    ;;
T)  # carry .device-tl (../shared/device/pack-tilelang), not .device; then E with --tilelang-v4 (FETCHED/T)
    mkdir -p /tmp/tl && xz -dc .device-tl/tilelang.tar.xz | tar -C /tmp/tl -xf -
    PYTHONPATH=/tmp/tl:. t 560 tilelang_v4 $py -m bench.tilelang_step --boundary --step-hidden 4096 7168 \
        --step-rows 1 16 128 512 --out "$log/tilelang-v4.json" --parity "$log/parity.pt"
    ;;
D)  # .device/fp.tar: git archive -o .device/fp.tar wip/finish-prefetch (the branch brought up to main first)
    ab="$py -m bench.experiments.mxfp8_ablation --hidden 4096 7168 --rows 1 16 --ablation shipped"
    mkdir -p /tmp/fp && tar -C /tmp/fp -xf .device/fp.tar
    t 200 finish_main $ab
    (cd /tmp/fp && MHC_BOUNDARY_CACHE_DIR=/tmp/fp/.cache t 200 finish_prefetch $ab)
    t 150 own_pre_gpu_prefetch bash -c "cd /tmp/fp && MHC_BOUNDARY_CACHE_DIR=/tmp/fp/.cache $py -m pytest -q -m gpu tests/test_own_pre_gpu.py"
    ;;
C)
    t 560 late $py -m pytest -q -m gpu -rs tests/test_late_rank_gpu.py
    ;;
F2)
    oc="$py -m bench.experiments.v4_one_cluster"
    t 200 persistent $oc --hidden 7168 --rows 128 512 --variant persistent exact --weights cold
    t 300 memcheck compute-sanitizer --tool memcheck $oc --hidden 7168 --rows 1 9 --variant exact \
        --forms bf16 mxfp8 --replays 1
    ;;
H)
    t 560 ncu $py profiles/profile_all.py --hidden 7168 --rows 16 512 --only v4-final own-pre
    ;;
M)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    w=$(nvidia-smi -L | wc -l)
    t 250 mp $py -m pytest -q -m gpu -rs tests/test_allreduce_multiprocess.py
    t 150 demo_v41 $py -m boundary.demo --tp "$w" --hidden 7168
    t 150 demo_v4 $py -m boundary.demo --tp "$w" --hidden 7168 --scheme v4
    t 250 allreduce $py -m bench --parts allreduce --world "$w"
    ;;
*)
    echo "unknown step $step" >&2; exit 2 ;;
esac
