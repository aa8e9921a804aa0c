#!/bin/bash
# Issue 20 item 1 on the GPU machine: the embedded model writes its own training prompts, then a DFlash2
# drafter is distilled from its greedy answers. Resumable: run the same command again (back to back, while
# the machine is warm) and it goes on from the work directory; it exits 75 while unfinished.
# The embedded GGUF (98 MB) and the tree are over one call's 64 MiB, so the GGUF travels in ignored parts,
#   each carried beside the tree in its own call (the parts wait in the work directory between calls):
#   g=<the GGUF>; split -b 25000000 $g .gguf_parts/part.; sha256sum $g | cut -d' ' -f1 > .gguf_parts/SHA256
#   (four parts: each fits beside the tree with .continuations/ or .whl/; carry .gguf_parts/SHA256 in every call)
# A call that stops unfinished sends back the recorded continuations (token ids, ~12 MB): kept in .continuations/
#   and carried in a later machine's first call, they save the recording (~250 s). The machine stays warm only
#   30 s after a call: make the next call at once.
# Usage: bash benchmarks/gpu/h200_train_drafter.sh OUT SECONDS   (SECONDS: this call's budget for the pipeline)
out=${1:?output directory}
budget=${2:?seconds this call may spend}
start=$(date +%s)
source benchmarks/gpu/setup.sh
export PYTHONPATH=${PYTHONPATH:-$PWD}
work=/tmp/drafter_work
mkdir -p $work
# Continuations that came back from an earlier machine (ignored folder .continuations/) skip the recording.
if [ ! -d $work/train ] && compgen -G ".continuations/continuations.tgz.*" > /dev/null; then
  cat .continuations/continuations.tgz.* | tar xzf - -C $work
fi
model=$work/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f $model ]; then
  cp .gguf_parts/part.* .gguf_parts/SHA256 $work/ 2>/dev/null || { echo "no GGUF parts here" >&2; exit 2; }
  cat $work/part.* > $model.tmp
  if [ "$(sha256sum < $model.tmp | cut -d' ' -f1)" != "$(cat $work/SHA256)" ]; then
    rm $model.tmp; echo "GGUF parts so far: $(ls $work | grep -c '^part\.'): send the next"; exit 75
  fi
  mv $model.tmp $model && rm $work/part.*
fi
engine="--model $model --device cuda --gpu-memory-utilization 0.4"
# The 50,000 prompts of 2026-12-03 (make-prompts below, same seed) are committed; MAKE_PROMPTS=1 writes them anew.
if [ ! -f $work/prompts.jsonl ] && [ -z "$MAKE_PROMPTS" ] && [ -f benchmarks/data/selfwritten_prompts.jsonl.gz ]; then
  zcat benchmarks/data/selfwritten_prompts.jsonl.gz > $work/prompts.jsonl
fi
if [ ! -f $work/prompts.jsonl ]; then
  timeout $((budget - 30)) python3 -m pressroom.entrypoints.cli make-prompts $engine --num-prompts 50000 \
    --batch 2048 --max-cudagraph-capture-size 1024 --output $work/prompts.tmp 2>&1 | tail -4 \
    && mv $work/prompts.tmp $work/prompts.jsonl
  [ -f $work/prompts.jsonl ] || { echo "make-prompts did not finish"; exit 75; }
fi
gzip -c $work/prompts.jsonl > "$out/prompts.jsonl.gz"
left=$((budget - ($(date +%s) - start) - 20))
# METHOD=dspark trains a DSpark drafter (DeepSpec's layout) from the same recording instead of a DFlash2 one.
if [ "${METHOD:-dflash2}" = dspark ]; then
  shape="--method dspark --num-layers ${LAYERS:-2} --markov-rank ${MARKOV_RANK:-32} --draft-block-size ${BLOCK:-7}"
else
  shape="--num-layers 2 --rank 16 --scorer-steps ${SCORER_STEPS:-$((${STEPS:-20000} / 4))}"
fi
python3 -m pressroom.entrypoints.cli train-drafter $engine --max-cudagraph-capture-size 1024 \
  --dataset-path $work/prompts.jsonl --held-out-path benchmarks/data/chat_heldout.jsonl --chat \
  --num-prompts 50000 --max-tokens 160 --record-batch 2048 $shape --steps ${STEPS:-20000} \
  --batch-size 512 --lr 1.5e-3 --validation-fraction 0.02 --eval-every 1000 --patience 4 --save-dtype bfloat16 \
  --work-dir $work/train --checkpoint-every 1000 --time-limit $left --output $work/drafter > $work/train.log 2>&1
rc=$?
tr '\r' '\n' < $work/train.log | grep -v -e "^$" -e "step/s" | tail -40  # tqdm redraws one line with \r
cp $work/train.log "$out/" 2>/dev/null
if [ $rc -eq 0 ]; then cp $work/drafter/* "$out/"
else  # the recorded continuations (token ids) come back, to carry into a later machine's work directory
  (cd $work && tar cf - train/train-*.pt train/heldout-*.pt 2>/dev/null) | gzip -1 | split -b 15000000 - "$out/continuations.tgz."
fi
exit $rc
