"""Writes train.jsonl / eval.jsonl: ISO dates to be spelled out ("2021-07-14" -> "14 July 2021").

A fixed answer format the base Gemma 3 270M does not produce on its own; deterministic (seeded), so the
files in this folder are exactly what this script writes:

    python examples/date_format/make_data.py
"""

import datetime
import json
import os
import random

MONTHS = "January February March April May June July August September October November December".split()


def record(day: datetime.date) -> dict:
    return {
        "prompt": f"Spell out the date {day.isoformat()}.",
        "completion": f"{day.day} {MONTHS[day.month - 1]} {day.year}",
    }


def main() -> None:
    rng = random.Random(0)
    start = datetime.date(1950, 1, 1).toordinal()
    days = rng.sample(range(start, start + 100 * 365), 340)
    here = os.path.dirname(os.path.abspath(__file__))
    for name, part in (("train", days[:300]), ("eval", days[300:])):
        with open(os.path.join(here, f"{name}.jsonl"), "w", encoding="utf-8") as f:
            for d in part:
                f.write(json.dumps(record(datetime.date.fromordinal(d))) + "\n")


if __name__ == "__main__":
    main()
