#!/bin/bash
# Pre-registered run of 41fa222 (bench/results/lifecycle/fresh20261202/README.md): DPO then GRPO, one process at a time.
set -e
cd /tmp/g12c/tree
export PYTHONPATH=/tmp/g12c/tree/src:/tmp/g12c/tree
PY=/work/main/.venv/bin/python
date -u +"dpo start %FT%TZ" >> /tmp/g12c/times.log
/usr/bin/time -v nice -n 10 $PY -m bench.lifecycle --seeds 3 --set sft_seeds=3 --set test_seed=20261202 \
    --set pair_temperature=0.7 --set dpo_steps=120 --stages dpo \
    --workdir /tmp/g12c/work --reuse --no-write --json /tmp/g12c/dpo.json > /tmp/g12c/dpo.log 2>&1
date -u +"dpo end %FT%TZ" >> /tmp/g12c/times.log
date -u +"grpo start %FT%TZ" >> /tmp/g12c/times.log
/usr/bin/time -v nice -n 10 $PY -m bench.lifecycle --seeds 3 --set sft_seeds=3 --set test_seed=20261202 \
    --set grpo_lr=5e-5 --set grpo_steps=40 --stages grpo \
    --workdir /tmp/g12c/work --reuse --no-write --json /tmp/g12c/grpo.json > /tmp/g12c/grpo.log 2>&1
date -u +"grpo end %FT%TZ" >> /tmp/g12c/times.log
