#!/bin/bash
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi -L; date -u
P=eager,inductor-fro,inductor-freezing-reduce-overhead-cudnn-default
Z="python3 -m fxopt.bench --zoo --cells fp16-b1 --peers $P"
timeout 230 $Z --models timm/eca_nfnet_l0,timm/mobilenetv3_large_100 --out /tmp/z1 2>/tmp/z1.err >/dev/null; echo "z1 rc $?"
[ -f /tmp/z1/zoo.json ] && gzip -c /tmp/z1/zoo.json > $OUT/z1.json.gz; tail -c 3000 /tmp/z1.err > $OUT/z1.err
timeout 130 $Z --models timm/mobilenetv3_large_100 --same-thread --out /tmp/z2 2>/tmp/z2.err >/dev/null; echo "z2 rc $?"
[ -f /tmp/z2/zoo.json ] && gzip -c /tmp/z2/zoo.json > $OUT/z2.json.gz; tail -c 3000 /tmp/z2.err > $OUT/z2.err
python3 - <<'PY'
import json, os
for z in ("z1","z2"):
    p=f"/tmp/{z}/zoo.json"
    if not os.path.exists(p): continue
    d=json.load(open(p)); print("==", z, d["meta"].get("backend_threads"))
    for c in d["cells"]:
        print(f'{c["model"][5:22]:18s} {c["backend"][:40]:40s} {c["status"]:6s} med {c.get("median_ms") or 0:.3f} host {c.get("host_ms") or 0:.3f} rounds {c.get("round_medians_ms")} {str(c.get("note") or "")[:80]} {str(c.get("error"))[:80]}')
PY
date -u
