#!/bin/bash
# The pre-registered five-chain run (README.md here), as it was run: two processes at a time on
# 2 cores, every model under runs/lifecycle (the SFT models of chains 0-4 were trained by the
# validation runs of the same day with these SFT settings and are taken back by --reuse, which
# refuses a model trained with other settings). `make lifecycle` runs the same stages in one
# process after another.
set -e
cd "$(dirname "$0")/../../../.."
PY=.venv/bin/python
OUT=bench/results/lifecycle/fresh20261204
L="$PY -m bench.lifecycle --workdir runs/lifecycle --reuse --no-write"
( $L --only-seeds 0,2,4 --json $OUT/main_024.json > runs/lifecycle/main_024.log 2>&1 ) &
( $L --stages dpo --rpo --json $OUT/rpo.json > runs/lifecycle/rpo.log 2>&1 &&
  $L --only-seeds 1,3 --json $OUT/main_13.json > runs/lifecycle/main_13.log 2>&1 ) &
wait
$L --stages chaos --only-seeds 0 --json $OUT/chaos.json > runs/lifecycle/chaos.log 2>&1
$PY -m bench.lifecycle --merge $OUT/main_024.json $OUT/main_13.json $OUT/rpo.json $OUT/chaos.json
# Added after the chaos rows were scored (not pre-registered): chain 0 as the same 2-group jobs
# without failures, to tell what the failures changed from what the 2-group layout changes.
# ( mkdir -p runs/lifecycle-control; ln -s ../lifecycle/pretrain ../lifecycle/sft0 runs/lifecycle-control/ )
# $PY -m bench.lifecycle --workdir runs/lifecycle-control --reuse --no-write --stages chaos \
#     --only-seeds 0 --set chaos_mtbf=0 --json $OUT/control_no_failures.json
