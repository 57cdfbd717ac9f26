#!/bin/bash
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -c "import fxopt.passes" || exit 3
nvidia-smi -L; date -u; T0=$(date +%s)
timeout 250 python3 -m fxopt.bench.serving --models resnet18 --device cuda --calls 1000 --backends fxopt,inductor-default --size-oblivious --fxopt-options '{"max_specializations": 64}' --out /tmp/sv > /tmp/sv.log 2>&1
echo "serving rc $? $(( $(date +%s) - T0 )) s"; [ -f /tmp/sv/serving.json ] && gzip -c /tmp/sv/serving.json > $OUT/serving.json.gz; tail -c 2500 /tmp/sv.log > $OUT/serving.log
python3 - <<'PY'
import json, os
p = "/tmp/sv/serving.json"
if os.path.exists(p):
    d = json.load(open(p))
    for r in d["results"]:
        print(r["backend"], {ph: {k: r[ph].get(k) for k in ("dynamo_graphs", "compile_s", "overhead_s", "steady_ms_median", "call_ms_p99", "calls_not_served_by_fxopt")} for ph in ("batch", "image") if ph in r},
              "peak", r.get("peak_gpu_mb"), "lowerings", r.get("fxopt_size_lowerings_s"), "first", r.get("fxopt_size_first_calls_s"))
        print("  vs static", json.dumps(r.get("latency_vs_static"))[:900])
PY
LEFT=$(( 560 - ($(date +%s) - T0) ))
echo "left for thr2 $LEFT"
[ $LEFT -gt 120 ] && BUDGET=$LEFT bash .devrun/thr2.sh
date -u
