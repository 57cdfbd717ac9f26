#!/bin/bash
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi -L
python3 -c "from torch._inductor import cudagraph_trees as c; print('init_tls', hasattr(c,'_initialize_tls'))"
P=eager,inductor-fro,inductor-freezing-reduce-overhead-cudnn-default
T0=$(date +%s)
Z="python3 -m fxopt.bench --zoo --cells fp16-b1 --peers $P"
$Z --models timm/eca_nfnet_l0,timm/mobilenetv3_large_100 --out /tmp/z1 2>/tmp/z1.err >/dev/null
LEFT=$(( ${BUDGET:-420} - ($(date +%s) - T0) - 20 ))
[ $LEFT -gt 60 ] && $Z --models timm/mobilenetv3_large_100 --same-thread --out /tmp/z2 2>/tmp/z2.err >/dev/null
LEFT=$(( ${BUDGET:-420} - ($(date +%s) - T0) - 20 ))
echo "left $LEFT"
[ $LEFT -gt 60 ] && $Z --models timm/resnet50,timm/efficientnet_b0,timm/regnety_016,timm/tf_efficientnet_lite0,timm/rexnet_100,timm/dla34 --time-budget $LEFT --out /tmp/z3 2>/tmp/z3.err >/dev/null
for z in z1 z2 z3; do [ -f /tmp/$z/zoo.json ] && gzip -c /tmp/$z/zoo.json > $OUT/$z.json.gz && cp /tmp/$z/zoo.md $OUT/$z.md; tail -c 3000 /tmp/$z.err > $OUT/$z.err; done
python3 - <<'PY'
import json, glob, os
for z in ("z1","z2","z3"):
    p=f"/tmp/{z}/zoo.json"
    if not os.path.exists(p): continue
    d=json.load(open(p)); print("==", z, d["meta"].get("backend_threads"))
    for c in d["cells"]:
        print(f'{c["model"][5:22]:18s} {c["backend"][:40]:40s} {c["status"]:6s} med {c.get("median_ms") or 0:.3f} host {c.get("host_ms") or 0:.3f} rounds {c.get("round_medians_ms")} {str(c.get("error"))[:60]}')
PY
