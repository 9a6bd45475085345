#!/usr/bin/env bash
# Per-kernel times of one decode step under Nsight Compute, on the GPU machine: builds like
# gpu_suite.sh, profiles the first step's kernels (serialized, so no launch overlap) and prints
# each kernel's count, total and mean time, DRAM bytes, bandwidth, registers and occupancy.
# CONFIG, BATCH and CONTEXT pick the shapes (default: Qwen3-30B-A3B, batch 1, context 1024);
# EXTRA adds bench arguments (e.g. EXTRA="--layers 5" for a slice). Results in $OUT/ncu.csv.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
CONFIG=${CONFIG:-configs/qwen3-30b-a3b-nvfp4.json}
BATCH=${BATCH:-1}
CONTEXT=${CONTEXT:-1024}
source scripts/gpu_env.sh
mkdir -p "$OUT"
gpu_build "$OUT/build.log" kestrel || exit 1
ncu --clock-control none \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
  -k 'regex:^(?!fill)' --launch-count 600 --csv \
  "$BUILD/src/kestrel" bench --config "$CONFIG" --random-weights --batch "$BATCH" --context "$CONTEXT" --steps 1 ${EXTRA:-} \
  >"$OUT/ncu.csv" 2>"$OUT/ncu.err" || { tail -5 "$OUT/ncu.err"; exit 1; }
python3 - "$OUT/ncu.csv" <<'PY'
import collections, csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next(i for i, r in enumerate(rows) if 'Kernel Name' in r)
h = rows[head]
kernel, metric, value, ident = (h.index(k) for k in ('Kernel Name', 'Metric Name', 'Metric Value', 'ID'))
per = collections.defaultdict(dict)
for r in rows[head + 1:]:
    name = r[kernel].split('(')[0].replace('kestrel::cuda::', '').replace('<unnamed>::', '')
    per[(int(r[ident]), name)][r[metric]] = float(r[value].replace(',', ''))
agg = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
for (_, name), m in per.items():
    a = agg[name]
    a[0] += 1
    a[1] += m.get('gpu__time_duration.sum', 0) / 1e3
    a[2] += m.get('dram__bytes_read.sum', 0) / 1e6
    a[3] = m.get('launch__registers_per_thread', 0)
    a[4] += m.get('sm__warps_active.avg.pct_of_peak_sustained_active', 0)
print(f"{sum(a[0] for a in agg.values())} kernels, {sum(a[1] for a in agg.values()):.0f} us in all")
print(f"{'kernel':34s} {'calls':>5s} {'us':>8s} {'us/call':>8s} {'MB':>8s} {'GB/s':>6s} {'regs':>4s} {'occ':>4s}")
for name, a in sorted(agg.items(), key=lambda x: -x[1][1]):
    print(f"{name[:34]:34s} {a[0]:5d} {a[1]:8.1f} {a[1] / a[0]:8.2f} {a[2]:8.1f} {a[2] / a[1] * 1e3:6.0f} {a[3]:4.0f} {a[4] / a[0]:3.0f}%")
PY
