"""Test hooks and signals of ``hpczeco train`` (the reliability tests drive them; not for production use).

- ``$HPCZECO_FAULT_KILL=RANK:STEP``: that rank SIGKILLs itself in that step (after its forward/backward, before the
  gradient all-reduce); ``$HPCZECO_FAULT_STOP``: it SIGSTOPs itself there (the others must end within the collective
  timeout, naming it); ``$HPCZECO_FAULT_RAISE``: it raises an internal error (RuntimeError) there.
- ``$HPCZECO_SOAK_REPORT=N``: every rank prints one ``soak:`` line (VmRSS, scan handles in flight, pooled buffers)
  to stderr after step N and after the last step (leak checks).
- :data:`CHECKPOINT_SIGNAL` (SIGUSR1; Slurm's ``--signal=B:USR1@120`` forwarded to the ranks): with ``--ckpt-dir``
  every rank finishes its step, writes a checkpoint and stops.
"""

from __future__ import annotations

import os
import signal
import sys
import time

__all__ = ["FAULT_KILL_ENV", "FAULT_STOP_ENV", "FAULT_RAISE_ENV", "SOAK_REPORT_ENV", "CHECKPOINT_SIGNAL",
           "SignalFlag", "Faults", "soak_line"]

FAULT_KILL_ENV = "HPCZECO_FAULT_KILL"
FAULT_STOP_ENV = "HPCZECO_FAULT_STOP"
FAULT_RAISE_ENV = "HPCZECO_FAULT_RAISE"
SOAK_REPORT_ENV = "HPCZECO_SOAK_REPORT"
CHECKPOINT_SIGNAL = signal.SIGUSR1


class SignalFlag:
    """Sets ``raised`` when ``signum`` arrives (installed from the main thread only; else inert)."""

    def __init__(self, signum: int):
        self.signum: int | None = signum
        self.raised = False
        try:
            self._old = signal.signal(signum, self._handler)
        except ValueError:  # not the main thread
            self.signum = None

    def _handler(self, signum, frame) -> None:
        self.raised = True

    def restore(self) -> None:
        if self.signum is not None:
            signal.signal(self.signum, self._old)


def _fault_at(name: str) -> tuple[int, int] | None:
    env = os.environ.get(name, "").strip()
    if not env:
        return None
    try:
        r, s = env.split(":")
        return int(r), int(s)
    except ValueError:
        raise ValueError(f"${name} must be RANK:STEP, got {env!r}") from None


class Faults:
    """The fault-injection settings read once from the environment; :meth:`here` fires them."""

    def __init__(self):
        self.kill, self.stop = _fault_at(FAULT_KILL_ENV), _fault_at(FAULT_STOP_ENV)
        self.bug = _fault_at(FAULT_RAISE_ENV)
        self.soak_at = int(os.environ.get(SOAK_REPORT_ENV, "0") or 0)

    def here(self, rank: int, step: int) -> None:
        """Between this rank's backward and the gradient all-reduce of ``step``."""
        if self.kill == (rank, step):
            _say(f"hpczeco train: fault injection: rank {rank} SIGKILLs itself in step {step} at t={time.time():.3f}")
            os.kill(os.getpid(), signal.SIGKILL)
        if self.stop == (rank, step):
            _say(f"hpczeco train: fault injection: rank {rank} SIGSTOPs itself in step {step} at t={time.time():.3f}")
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.bug == (rank, step):
            _say(f"hpczeco train: fault injection: rank {rank} raises in step {step} at t={time.time():.3f}")
            raise RuntimeError(f"fault injection: rank {rank} raises in step {step}")


def _say(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def _rss_kb() -> int:
    """This process's resident set size (kB) from /proc/self/status (-1 where unavailable)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def soak_line(comm, rank: int, step: int) -> str:
    """The ``soak:`` line of this rank (``comm``: the communicator the ZeCO scans run on)."""
    from hpczeco.collectives.scan import scan_stats

    st = scan_stats(comm)
    return (f"soak: rank {rank} step {step} rss_kb {_rss_kb()} inflight {st['inflight']} "
            f"started {st['started']} pooled {st['pooled']} pooled_bytes {st['pooled_bytes']}\n")
