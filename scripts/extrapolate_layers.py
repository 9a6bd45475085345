#!/usr/bin/env python3
"""Full-depth decode step estimates from two layer slices of one model.

    python3 scripts/extrapolate_layers.py OUT NAME:LAYERS ...

reads OUT/bench_NAME-l5.json and OUT/bench_NAME-l9.json (kestrel bench --layers 5 / 9, the
same batches and context) and prints, per batch size, the time and floor of one MoE layer
((l9 - l5) / 4) and the full model's step extrapolated as l9 + (LAYERS - 9) x one layer. The
extrapolation assumes every layer past the ninth costs what layers 6-9 cost (true of GLM-5 and
DeepSeek-V3: all MoE, same shapes).
"""
import json
import sys
from pathlib import Path


def steps(path: Path) -> dict:
    return {r["batch"]: r for r in json.loads(path.read_text())["steps"]}


def main() -> int:
    out = Path(sys.argv[1])
    print("extrapolated to the full depth from 5- and 9-layer slices (per MoE layer = (l9 - l5) / 4):")
    print(f"{'model':>14} {'batch':>7} {'layer ms':>9} {'layer floor':>12} {'x floor':>8} {'full ms':>9} "
          f"{'full floor':>11} {'x floor':>8} {'tok/s':>8}")
    for arg in sys.argv[2:]:
        name, layers = arg.split(":")
        layers = int(layers)
        a, b = out / f"bench_{name}-l5.json", out / f"bench_{name}-l9.json"
        if not (a.exists() and b.exists()):
            print(f"{name:>14} (missing {a.name} or {b.name})")
            continue
        s5, s9 = steps(a), steps(b)
        for batch in sorted(set(s5) & set(s9)):
            lt = (s9[batch]["graph_ms"] - s5[batch]["graph_ms"]) / 4
            lf = (s9[batch]["floor_ms"] - s5[batch]["floor_ms"]) / 4
            ft = s9[batch]["graph_ms"] + (layers - 9) * lt
            ff = s9[batch]["floor_ms"] + (layers - 9) * lf
            print(f"{name:>14} B={batch:<5d} {lt:9.3f} {lf:12.3f} {lt / lf:8.2f} {ft:9.2f} {ff:11.2f} {ft / ff:8.2f} "
                  f"{batch * 1e3 / ft:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
