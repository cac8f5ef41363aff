"""argparse ``type=`` converters for the services' command-line flags: a number out of its range
is a usage error that names the flag, before anything starts (a flag is an edge, like the
environment's settings, whose bounds live in :mod:`services.settings`).

>>> import argparse
>>> p = argparse.ArgumentParser(prog="x", exit_on_error=False)
>>> _ = p.add_argument("--passes", type=at_least(1))
>>> _ = p.add_argument("--fraction", type=fraction)
>>> p.parse_args(["--passes", "3", "--fraction", "0.5"])
Namespace(passes=3, fraction=0.5)
>>> try:
...     p.parse_args(["--passes", "0"])
... except argparse.ArgumentError as err:
...     print(err)
argument --passes: must be at least 1, got 0
>>> try:
...     p.parse_args(["--fraction", "1"])
... except argparse.ArgumentError as err:
...     print(err)
argument --fraction: must be in [0, 1), got 1
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from pydantic import ValidationError

from services.settings import refused_setting

__all__ = ["at_least", "fraction", "run_main", "tcp_port"]


def at_least(low: float, kind: type[int] | type[float] = int) -> Callable[[str], float]:
    """A number of type ``kind`` (int, or float) that is at least ``low``."""
    def parse(text: str) -> float:
        value: float = kind(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value
    parse.__name__ = f"{kind.__name__} >= {low}"  # (argparse's "invalid ... value: 'x'" names it)
    return parse


def fraction(text: str) -> float:
    """A float in [0, 1)."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def tcp_port(text: str) -> int:
    """A TCP port number (0: any free one)."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {text}")
    return value


def run_main(main: Callable[[], int | None], prog: str) -> int:
    """A service's ``main`` run as ``python -m``: its exit code, and a refused setting (from the
    environment, or a flag applied as one) one line on stderr and exit code 2, as ``driftline``
    prints it, not pydantic's traceback.

    >>> from services.settings import Settings
    >>> run_main(lambda: Settings().updated(trainer={"batch_size": 0}) and 0, "python -m trainer")
    2
    """
    try:
        return int(main() or 0)
    except ValidationError as err:
        if err.title != "Settings":
            raise
        print(f"{prog}: {refused_setting(err)}", file=sys.stderr)
        return 2
