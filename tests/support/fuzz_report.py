"""Sums the case counts `make fuzz` collected: `python -m tests.support.fuzz_report FILE`.
Prints one line per fuzzed operation, then the total as the last line."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path


def main(path: str) -> int:
    total, statuses = 0, Counter()
    for line in Path(path).read_text().splitlines():
        entry = json.loads(line)
        total += entry["cases"]
        statuses.update({int(k): v for k, v in entry["statuses"].items()})
        print(f"  {entry['cases']:6d}  {entry['name']}")
    server_errors = sum(v for k, v in statuses.items() if k >= 500)
    by_status = ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))
    print(f"fuzz: {total} cases against the gateway ({by_status}); 5xx: {server_errors}")
    return 1 if server_errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
