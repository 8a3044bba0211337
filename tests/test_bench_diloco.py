"""bench.diloco's arithmetic: the sizes it parses, the gap to sync paired by seed, and the bytes
it counts per token for each arm (a few inner steps of a tiny model)."""

from __future__ import annotations

import argparse
import math

import pytest

from bench.common import t_interval
from bench.diloco import ARMS, counted_bytes, parse_sizes, quality_rows, run


def test_sizes_are_parsed_and_a_bad_one_names_the_fix() -> None:
    assert parse_sizes("tiny:2000,small:300") == [("tiny", 2000), ("small", 300)]
    for bad in ("tiny", "huge:300", "tiny:50", "tiny:x"):
        with pytest.raises(SystemExit, match="SIZE:INNER_STEPS"):
            parse_sizes(bad)


def test_the_gap_to_sync_is_paired_by_seed() -> None:
    """Seed 1 is harder for every arm: paired, the gap's interval is tight; the loss's is not."""
    results = {("tiny", name): {seed: (base * (1 + 0.01 * k), 100.0 / (k + 1))
                                for seed, base in ((0, 2.0), (1, 3.0))}
               for k, name in enumerate(ARMS)}
    rows = {r[0]: r for r in quality_rows("tiny", results)}
    sync, h10 = rows["sync (every step)"], rows["diloco H=10"]
    assert sync[3] == "-" and h10[3] == "+1.00% ± 0.00"
    assert h10[5] == "2x"  # bytes per token: half of sync's
    mean, half = t_interval([2.02, 3.03])
    assert h10[1] == f"{mean:.4f} ± {half:.4f}" and half > 1
    assert math.isnan(t_interval([1.0])[1])


def test_bytes_per_token_follow_the_payloads() -> None:
    """Every step sends 4 bytes per parameter per group step; H=10 a tenth of that."""
    args = argparse.Namespace(batch=2, seq=16, vocab=64, lr=3e-3, inner_steps=10)
    loss_sync, sync = run(ARMS["sync (every step)"], 0, args, "tiny", 10)
    loss_h10, h10 = run(ARMS["diloco H=10"], 0, args, "tiny", 10)
    assert math.isfinite(loss_sync) and math.isfinite(loss_h10)
    assert sync / h10 == pytest.approx(10.0)


def test_counted_bytes_give_the_largest_exchange(tmp_path) -> None:
    """Real sessions: every step and plain DiLoCo each send the whole float32 model in one
    exchange; streaming with 4 int8 fragments sends about a sixteenth of it at once."""
    args = argparse.Namespace(batch=2, seq=16, vocab=64, lr=3e-3)
    counted = {name: (per_token, largest) for name, per_token, largest in counted_bytes(args, str(tmp_path))}
    every, plain, streaming = (counted[k] for k in ("every step", "diloco H=100", "streaming H=100 F=4 int8"))
    assert every[1] == plain[1] > 0
    assert every[0] / plain[0] == pytest.approx(100.0, rel=0.01)
    assert plain[1] / 20 < streaming[1] < plain[1] / 10
