#!/bin/bash
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi -L
P=eager,inductor-fro,inductor-freezing-reduce-overhead-cudnn-default
T0=$(date +%s)
python3 -m fxopt.bench --zoo --models timm/eca_nfnet_l0 --cells fp16-b1 --peers $P --out $OUT/zoo_thr 2>$OUT/thr.err | tail -3
python3 -m fxopt.bench --zoo --models timm/eca_nfnet_l0 --cells fp16-b1 --peers $P --same-thread --out $OUT/zoo_same 2>$OUT/same.err | tail -3
LEFT=$(( ${BUDGET:-540} - ($(date +%s) - T0) - 90 ))
echo "left $LEFT"
[ $LEFT -gt 60 ] && python3 -m fxopt.bench --zoo --models timm/efficientnet_b0,timm/mobilenetv3_large_100,timm/resnet50,timm/rexnet_100,timm/regnety_016,timm/tf_efficientnet_lite0 --cells fp16-b1 --peers $P --time-budget $LEFT --out $OUT/zoo_b1 2>$OUT/b1.err | tail -3
for d in zoo_thr zoo_same zoo_b1; do grep -h "eca\|efficient\|mobilenet\|resnet\|rexnet\|regnet" $OUT/$d/zoo.md | grep "|" | head -12; done
