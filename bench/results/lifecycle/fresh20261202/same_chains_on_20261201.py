"""The three chains of this run (SFT seed s -> DPO seed s, GRPO seed s) as scored on the earlier
draw (test_seed 20261201) by the runs of fresh20261201/. Their models are bit-identical to this
run's (sha256 of model.safetensors; training is deterministic). This is context seen before the
pre-registration, not a pre-registered result.

    python bench/results/lifecycle/fresh20261202/same_chains_on_20261201.py
"""
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
from bench.lifecycle import paired  # noqa: E402

EARLIER = ROOT / "bench" / "results" / "lifecycle" / "fresh20261201"


def stages(name: str) -> dict:
    return json.loads((EARLIER / name).read_text())["stages"]


sft = {"0": stages("c_dpoc.json")["SFT"]["0"], "1": stages("c_sft1.json")["SFT"]["1"],
       "2": stages("c_sft2.json")["SFT"]["2"]}
dpo = {"0": stages("c_dpoc.json")["DPO, val-best"]["0"],
       "1": stages("sft1/s1_dpoc.json")["DPO, val-best"]["1"],
       "2": stages("sft2/s2_dpoc.json")["DPO, val-best"]["2"]}
grpo = {"0": stages("c_grpo40.json")["GRPO, 40-step"]["0"],
        "1": stages("sft1/s1_grpo40.json")["GRPO, 40-step"]["1"],
        "2": stages("sft2/s2_grpo40.json")["GRPO, 40-step"]["2"]}
result = {"stages": {"SFT": sft, "DPO": dpo, "GRPO": grpo}}
for row, by_seed in result["stages"].items():
    accs = [e["acc"] for e in by_seed.values()]
    print(f"{row}: mean {statistics.fmean(accs):.3f}, per chain "
          + ", ".join(f"{a:.3f}" for a in accs))
for row in ("DPO", "GRPO"):
    mean, interval = paired(result, row, "SFT")
    print(f"{row} - SFT, paired per task on the 20261201 draw: {mean:+.3f} ± {interval:.3f}")
