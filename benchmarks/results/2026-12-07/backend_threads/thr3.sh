#!/bin/bash
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi -L
python3 -m fxopt.bench --zoo --cells fp16-b1 --peers inductor-fro --models timm/eca_nfnet_l0 --out /tmp/z1 2>/tmp/z1.err >/dev/null
[ -f /tmp/z1/zoo.json ] && gzip -c /tmp/z1/zoo.json > $OUT/z1.json.gz && cp /tmp/z1/zoo.md $OUT/z1.md; tail -c 3000 /tmp/z1.err > $OUT/z1.err
python3 - <<'PY'
import json, os
d=json.load(open("/tmp/z1/zoo.json")); print("==", d["meta"].get("backend_threads"))
for c in d["cells"]:
    print(f'{c["model"][5:22]:18s} {c["backend"][:40]:40s} {c["status"]:6s} med {c.get("median_ms") or 0:.3f} host {c.get("host_ms") or 0:.3f} rounds {c.get("round_medians_ms")} hostus {c.get("round_host_us")} {str(c.get("error"))[:60]}')
PY
