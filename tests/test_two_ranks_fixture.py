"""The ``two_ranks`` fixture (tests/conftest.py): each rank's script runs to its end, its report
is read, and it leaves without the interpreter's teardown, keeping a failing script's status."""

from __future__ import annotations

import pytest

REPORT = """
import json, sys
rank, store = int(sys.argv[1]), sys.argv[2]
class Point:  # defined in __main__, as a script's own classes are
    pass
import pickle
pickle.dumps(Point())
print(json.dumps({"rank": rank, "args": sys.argv[3:], "store": bool(store)}))
"""


def test_each_rank_runs_the_script_with_its_rank_store_and_arguments(two_ranks) -> None:
    assert two_ranks(REPORT, "a", "b", timeout=60) == [
        {"rank": 0, "args": ["a", "b"], "store": True}, {"rank": 1, "args": ["a", "b"], "store": True}]


@pytest.mark.parametrize("ending, status", [("raise RuntimeError('boom')", 1), ("sys.exit(3)", 3),
                                            ("sys.exit('bad input')", 1)])
def test_a_failing_rank_keeps_its_status(two_ranks, ending, status) -> None:
    script = "import sys\nif sys.argv[1] == '1':\n    " + ending + "\nprint('{}')\n"
    with pytest.raises(AssertionError) as failed:
        two_ranks(script, timeout=60)
    assert f"[0, {status}]" in str(failed.value)
