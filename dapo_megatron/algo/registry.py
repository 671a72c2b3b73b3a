"""Named variants of the objective (verl's core_algos registers its losses and advantage estimators the
same way): one decorator puts a function under a key, every function of one registry has the same
signature, and the trainer looks the key of its config up here. A registry is typed by the Protocol of
its functions (Registry[PolicyLossFn], Registry[AdvantageFn]), so mypy checks every registration
against it and every call of a looked-up function.

The registries of the objective live beside their Protocol: POLICY_LOSSES in algo/policy_loss.py
(filled there and by algo/gspo.py), ADVANTAGES in algo/advantages.py, ROLLOUT_CORRECTIONS
(RolloutCorrectionFn) in algo/rollout_correction.py.

    @POLICY_LOSSES.register("gspo")
    def gspo_policy_loss(tokens: LossTokens, clip: ClipSettings) -> tuple[Tensor, dict[str, Tensor]]: ...

    @ADVANTAGES.register("grpo")
    def group_advantages(rewards: Tensor, group_index: Tensor, *, eps: float) -> Tensor: ...

    loss_fn = POLICY_LOSSES.get("gspo")       # ValueError naming the key and the registered names if unknown

A new variant is one function in one file of algo/, imported by algo/__init__.py, plus its name in
config.py's Literal (tests/unit/test_algo_objective.py checks that the two agree).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable[..., object])  # the registered functions' Protocol


class Registry(Generic[F]):
    """name -> function; `key` is the config key that selects one (it names the error)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._functions: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def add(function: F) -> F:
            if name in self._functions and self._functions[name] is not function:
                raise ValueError(
                    f"{self.key}: {name!r} is registered twice ({self._functions[name].__module__} "
                    f"and {function.__module__})"
                )
            self._functions[name] = function
            return function

        return add

    def get(self, name: str) -> F:
        if name not in self._functions:
            raise ValueError(f"{self.key}={name!r} is not registered; registered: {self.names()}")
        return self._functions[name]

    def names(self) -> list[str]:
        return sorted(self._functions)

    def __contains__(self, name: object) -> bool:
        return name in self._functions
