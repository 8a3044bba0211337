"""``[ft]`` settings that reach the coordinator."""

from __future__ import annotations

import pytest

from ftlm.errors import ConfigError
from ftlm.ft.config import FTConfig


def test_the_coordinators_connection_cap_is_a_job_setting() -> None:
    """Each group's leader holds two connections: a job of 4,000 groups needs more than the
    default 4,096, which ``ftlm coordinator`` could not be given before."""
    assert FTConfig().coordinator_config().max_connections == 4096
    assert FTConfig(coordinator_max_connections=10_000).coordinator_config().max_connections == 10_000


@pytest.mark.parametrize("bad", [0, 7, 2.5, "many", True])
def test_a_bad_connection_cap_names_the_field(bad) -> None:
    with pytest.raises(ConfigError, match=r"ft\.coordinator_max_connections=.* must be an integer >= 8"):
        FTConfig(coordinator_max_connections=bad)
