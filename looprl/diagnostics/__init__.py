"""Diagnosing runs: stacks on demand (stacks.py), out of memory by phase (oom.py), hang
patterns across ranks (hangs.py) and the watchdog that reports a stall (watchdog.py)."""
