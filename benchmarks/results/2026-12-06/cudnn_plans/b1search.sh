#!/bin/bash
# fresh processes: heur/search pairs for each model, then Inductor
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi -L; python3 -c "import torch;print(torch.__version__, torch.backends.cudnn.version())"
export FXOPT_CACHE_DIR=/tmp/fxc
for m in $MODELS; do
  for mode in heur search; do
    rm -rf /tmp/fxc; timeout 120 python3 .devrun/b1search.py $m $mode ${B:-1} 2>>$OUT/err.txt | tee -a $OUT/b1search.jsonl
  done
done
for m in $MODELS; do
  timeout 150 python3 .devrun/b1search.py $m ind ${B:-1} 2>>$OUT/err.txt | tee -a $OUT/b1search.jsonl
done
