"""``python -m labs.grading``: release learners' copies, grade their notebooks.

    python -m labs.grading release OUT_DIR
    python -m labs.grading grade STUDENT.ipynb|FOLDER [...] [--json [report.json]] [--seed N]

``grade`` takes notebooks and folders of them (every ``*.ipynb`` inside, links not
followed). It exits 0 when every exercise passed, 1 when any failed (a hand-in that cannot be
graded, a link or a file of no chapter, fails too, and the batch goes on), 2 on bad input
(a path that does not exist, a bad flag: nothing is run then).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from labs.grading.grader import DEFAULT_REFERENCE_DIR, DEFAULT_TIMEOUT_S, GradeSettings, grade
from labs.grading.handout import release
from labs.grading.isolation import Isolation
from labs.grading.notebook import GradingError

EXIT_FAILED = 1
EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m labs.grading", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rel = sub.add_parser("release", help="write the learners' copies (solutions stubbed)")
    rel.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    rel.add_argument("--force", action="store_true", help="overwrite notebooks in OUT_DIR")
    gr = sub.add_parser("grade", help="grade learners' notebooks")
    gr.add_argument("notebooks", nargs="+", type=Path, metavar="NOTEBOOK_OR_FOLDER")
    gr.add_argument("--json", type=Path, metavar="PATH", nargs="?", const=Path("-"),
                    help="also write the report as JSON to PATH; with no PATH (or -), print "
                         "it to stdout instead of the table")
    gr.add_argument("--seed", type=int, help="seed of the hidden cases (default: drawn)")
    gr.add_argument("--no-hidden", action="store_true", help="run the visible cases only")
    gr.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help="seconds each stage of an exercise may take (default %(default)s)")
    gr.add_argument("--check-timeout", type=float, metavar="S",
                    help="seconds a check's ranks may run once they have all started (default: "
                         "each check's own, 10 s); raise it on a machine busy with other work "
                         "(the report records it)")
    gr.add_argument("--no-isolation", action="store_true",
                    help="run the learners' code with your rights, not in a sandbox (only "
                         "where no sandbox can be made; the report says so)")
    gr.add_argument("--keep", type=Path, metavar="DIR",
                    help="keep the generated notebooks and logs in DIR")
    for command in (rel, gr):
        command.add_argument("--reference", type=Path, default=DEFAULT_REFERENCE_DIR,
                             help="the reference notebooks (default: %(default)s)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "release":
            for item in release(args.reference, args.out_dir, force=args.force):
                stubbed = ", ".join(item.exercises) or "no exercises"
                print(f"wrote {item.path} (stubbed: {stubbed})")
            return 0
        settings = GradeSettings(reference_dir=args.reference, seed=args.seed,
                                 timeout=args.timeout, check_timeout=args.check_timeout,
                                 hidden=not args.no_hidden,
                                 keep=args.keep,
                                 isolation=Isolation.NONE if args.no_isolation
                                 else Isolation.SANDBOX)
        report = grade(args.notebooks, settings, progress=True)
    except GradingError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    as_json = json.dumps(report.to_json(), indent=2)  # ASCII: every other character escaped
    # A terminal that cannot show a character gets its code, never an error for the batch.
    sys.stdout.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    if args.json is not None and str(args.json) == "-":
        print(as_json)
    else:
        print(report.table())
        if args.json is not None:
            args.json.write_text(as_json + "\n", encoding="ascii")
    return 0 if report.passed else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
