"""Locust load shapes for load_tests/locustfile.py, which binds the one named by $LOAD_SHAPE.

They read locust's own -u (users), -r (spawn rate) and -t (run time): with a shape class, locust leaves
stopping to the shape, so each returns None once -t has passed. The locustfile's options (--step-users,
--step-seconds, --rate) come from `parsed_options` too.
"""

from __future__ import annotations

from argparse import Namespace

from locust import LoadTestShape


class TimedShape(LoadTestShape):
    abstract = True
    use_common_options = True

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options
        if options.run_time and self.get_run_time() >= options.run_time:
            return None
        return self.users(options)

    def users(self, options: Namespace) -> tuple[int, float]:
        """(user count, spawn rate) now."""
        raise NotImplementedError


class ConstantUsers(TimedShape):
    """-u users, started at -r per second, kept until the end."""

    def users(self, options: Namespace) -> tuple[int, float]:
        return options.num_users, options.spawn_rate


class StepRamp(TimedShape):
    """--step-users more users every --step-seconds, up to -u."""

    def users(self, options: Namespace) -> tuple[int, float]:
        steps = 1 + int(self.get_run_time() // options.step_seconds)
        return min(options.num_users, steps * options.step_users), float(options.step_users)


class PoissonArrivals(TimedShape):
    """-u open-loop users started at once; each sends at --rate / -u, so together they are a Poisson
    process of --rate requests per second whatever the latency (users do not wait for their answers)."""

    def users(self, options: Namespace) -> tuple[int, float]:
        if options.rate <= 0:
            raise ValueError("the poisson shape needs --rate > 0 (requests per second, all users together)")
        return options.num_users, float(options.num_users)


SHAPES: dict[str, type[LoadTestShape]] = {
    "constant": ConstantUsers, "step": StepRamp, "poisson": PoissonArrivals,
}


def select(name: str) -> type[LoadTestShape]:
    if name not in SHAPES:
        raise ValueError(f"LOAD_SHAPE={name!r}: expected one of {', '.join(SHAPES)}")
    return SHAPES[name]
