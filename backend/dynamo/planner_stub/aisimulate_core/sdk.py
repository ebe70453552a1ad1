"""aisimulate_core.sdk's names, each a Refused (see the package's docstring)."""

from aisimulate_core import __getattr__  # noqa: F401  (a module's own __getattr__ serves its missing names)
