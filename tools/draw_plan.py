#!/usr/bin/env python3
"""Draw plan JSON files (StepPlan.dumps(), e.g. from dcp-simulate --dump-plans) as per-rank timelines.

    tools/draw_plan.py plans/static/step_0.json plans/dcp/step_0.json --out step0.png
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dcp_megatron.planner.plan import StepPlan  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plans", nargs="+", help="plan JSON files, one panel each")
    parser.add_argument("--out", required=True, help="output PNG")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    plans = {}
    for path in args.plans:
        try:
            with open(path) as f:
                plan = StepPlan.from_json(f.read())
        except (OSError, ValueError, KeyError, TypeError) as err:
            print(f"draw_plan: error: {path}: not a readable plan JSON ({err!r})", file=sys.stderr)
            return 2
        label = f"{plan.policy} ({path})" if plan.policy else path
        plans[label] = plan
    from dcp_megatron.plotting import draw_step_timelines
    draw_step_timelines(plans, args.out, title=args.title)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
