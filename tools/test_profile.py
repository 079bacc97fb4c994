"""Sum a test-suite profile per file: `DCP_TEST_PROFILE=prof.jsonl make test; python tools/test_profile.py prof.jsonl`.

Prints, per test file, the wall and CPU seconds (the pytest process plus the launches it waited for) and the
test count, largest CPU first, then the `--top` most expensive tests. CPU seconds are what a busy machine does
not inflate; wall seconds on a quiet machine are what CI waits for.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def per_file(records: list[dict]) -> list[tuple[str, float, float, int]]:
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0.0, 0])
    for record in records:
        total = totals[record["test"].split("::")[0]]
        total[0] += record["wall_s"]
        total[1] += record["cpu_s"]
        total[2] += 1
    return sorted(((name, wall, cpu, n) for name, (wall, cpu, n) in totals.items()), key=lambda row: -row[2])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="the JSON-lines file DCP_TEST_PROFILE wrote")
    parser.add_argument("--top", type=int, default=15, help="how many of the most expensive tests to list")
    args = parser.parse_args(argv)
    records = load(args.profile)
    if not records:
        raise SystemExit(f"{args.profile} holds no test records: run the suite with DCP_TEST_PROFILE={args.profile}")
    print(f"{'file':58s} {'tests':>5s} {'wall s':>8s} {'CPU s':>8s}")
    for name, wall, cpu, count in per_file(records):
        print(f"{name:58s} {count:5d} {wall:8.1f} {cpu:8.1f}")
    print(f"{'total':58s} {len(records):5d} {sum(r['wall_s'] for r in records):8.1f} "
          f"{sum(r['cpu_s'] for r in records):8.1f}")
    print(f"\nthe {args.top} most expensive tests (CPU s, wall s):")
    for record in sorted(records, key=lambda r: -r["cpu_s"])[:args.top]:
        print(f"  {record['cpu_s']:8.1f} {record['wall_s']:8.1f}  {record['test']}")


if __name__ == "__main__":
    main()
