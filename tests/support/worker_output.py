"""What a test reads from a training worker's stdout."""

import time


def read_until_step(proc, step: int, seen: list[str], timeout_s: float = 120) -> None:
    """Read ``proc``'s stdout until it prints ``STEP s`` for some s >= ``step``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError("the worker stopped early:\n" + "".join(seen[-40:]))
        seen.append(line)
        if line.startswith("STEP ") and int(line.split()[1]) >= step:
            return
    raise AssertionError(f"no STEP {step} within {timeout_s} s:\n" + "".join(seen[-40:]))
