"""What defining a record class costs, against a frozen slotted dataclass.

``kreld.core.record.record`` exists partly for this: a class the daemon and
kreldctl define at import must not cost what ``dataclasses.dataclass(frozen=True,
slots=True)`` costs.  One sample is 20 definitions of a four-field class; both
variants run round-robin in this process.  Goal: record <= 0.5x the dataclass.

Run alone: ``.venv/bin/python bench/bench_record.py [--quick]``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

from common import Result, bench_main, interleaved, log, median

from kreld.core.record import record

GOAL = 0.5
DC_TAG = "dataclass"
DC_DESC = "dataclasses.dataclass(frozen=True, slots=True) on the same class body"


def define_20(decorate: Callable[[type], object]) -> Callable[[], None]:
    def run() -> None:
        for _ in range(20):
            body = {"__annotations__": {"a": "int", "b": "str", "c": "int", "d": "str"}}
            body |= {"c": 0, "d": "", "__doc__": "doc"}
            decorate(type("R", (), body))

    return run


def run(quick: bool) -> list[Result]:
    """Defining 20 record classes against 20 frozen slotted dataclasses."""
    log("record: class definitions")
    samples = interleaved(
        {
            "record": define_20(record),
            "dataclass": define_20(lambda c: dataclasses.dataclass(c, frozen=True, slots=True)),
        },
        20 if quick else 200,
    )
    ours, theirs = median(samples["record"]), median(samples["dataclass"])
    return [
        Result(
            "20 @record class definitions p50",
            ours,
            "ns",
            theirs,
            DC_TAG,
            DC_DESC,
            f"<= {GOAL}x",
            ours <= GOAL * theirs,
        )
    ]


if __name__ == "__main__":
    sys.exit(bench_main("record", run))
