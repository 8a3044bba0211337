"""GRPO's rewards: the task suite's checkers, or a Python function the config names.

``reward_function(spec)`` turns ``post.reward`` (``"module:function"``; empty: the built-in checker
``post.verify`` names) into a ``Reward``: ``reward(tasks, completions) -> list[float]``, one reward
per completion, ``tasks[i]`` the task ``completions[i]`` answers.

A user function has the signature (the keywords are those of TRL's ``reward_funcs``: the prompts,
the completions, and the task's other fields, each a list aligned with the completions)::

    def my_reward(prompts: list[str], completions: list[str], *, answer: list[str],
                  family: list[str], key: list[str], solution: list[str], **_) -> list[float]

It is imported and checked when the command starts (``reward_function``: the module imports, the
name is a callable that accepts those keywords, and a call on the first training task's reference
solution returns one finite number), so that a typo fails before any training step; every later
call's result is checked too (one finite number per completion), naming the function on error.

Not responsible for: advantages and the loss (``ftlm.post.grpo``), sampling (``ftlm.post.rollout``).
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Sequence

from ftlm.errors import ConfigError
from ftlm.tasks import VERIFIERS, Task

Reward = Callable[[Sequence[Task], Sequence[str]], list[float]]
"""``reward(tasks, completions)``: one reward per completion, ``tasks[i]`` the one it answers."""

TASK_FIELDS = ("answer", "family", "key", "solution")
"""The task fields a user reward function receives as keyword lists (besides the prompts)."""

SIGNATURE = ("fn(prompts: list[str], completions: list[str], *, answer, family, key, solution, "
             "**_) -> list[float]")


def checker_reward(verify: Callable[[Task, str], bool]) -> Reward:
    """Reward 1.0 when ``verify(task, completion)`` accepts the completion, else 0.0."""
    def reward(tasks: Sequence[Task], completions: Sequence[str]) -> list[float]:
        return [float(verify(t, c)) for t, c in zip(tasks, completions)]
    return reward


def _user_reward(fn: Callable, spec: str) -> Reward:
    def reward(tasks: Sequence[Task], completions: Sequence[str]) -> list[float]:
        fields = {name: [getattr(t, name) for t in tasks] for name in TASK_FIELDS}
        values = fn(prompts=[t.prompt for t in tasks], completions=list(completions), **fields)
        return checked_rewards(values, len(completions), spec)
    return reward


def checked_rewards(values: object, count: int, spec: str) -> list[float]:
    """``values`` as ``count`` finite floats, or a ``ConfigError`` naming ``spec`` and the fault."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ConfigError(f"post.reward={spec!r} returned {type(values).__name__}; it must return "
                          f"a list of {count} numbers, one per completion ({SIGNATURE})")
    if len(values) != count:
        raise ConfigError(f"post.reward={spec!r} returned {len(values)} rewards for {count} "
                          f"completions; it must return one number per completion")
    out = []
    for i, v in enumerate(values):
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
        if not ok:
            raise ConfigError(f"post.reward={spec!r} returned {v!r} for completion {i}; every "
                              "reward must be a finite int or float")
        out.append(float(v))
    return out


def _import(spec: str) -> Callable:
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ConfigError(f"post.reward={spec!r} must be 'module:function' (e.g. "
                          "'my_rewards:length_penalty'), the module importable from PYTHONPATH")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"post.reward={spec!r}: module {module_name!r} cannot be imported ({e}); "
                          "put its folder on PYTHONPATH or fix the name") from e
    fn = module
    for part in name.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"post.reward={spec!r}: module {module_name!r} has no {name!r}")
    if not callable(fn):
        raise ConfigError(f"post.reward={spec!r} is a {type(fn).__name__}, not a function")
    return fn


def reward_function(spec: str, verify: str, probe: Task | None = None) -> Reward:
    """The reward of ``post.reward=spec`` (empty: the checker ``post.verify=verify``), checked as
    the module docstring says; ``probe`` (a task) is scored once with its reference solution."""
    if not spec:
        return checker_reward(VERIFIERS[verify])
    fn = _import(spec)
    try:
        inspect.signature(fn).bind(prompts=[], completions=[], **{f: [] for f in TASK_FIELDS})
    except TypeError as e:
        raise ConfigError(f"post.reward={spec!r} does not accept the reward keywords ({e}); its "
                          f"signature must be {SIGNATURE}") from e
    except ValueError:  # a builtin without an inspectable signature: the probe call decides
        pass
    reward = _user_reward(fn, spec)
    if probe is not None:
        try:
            reward([probe], [probe.solution])
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code: any failure is a setup error
            raise ConfigError(f"post.reward={spec!r} failed on its start-up check (the first "
                              f"training task's reference solution): {type(e).__name__}: {e}") from e
    return reward
