"""`python -m research.evaluation RUN_DIR [RUN_DIR...] --data LFW`: each run's View 1 verification,
one line per run, and `view1.json` in the run's directory."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from research.evaluation.run import evaluate_run
from splitface.common.options import add_data_root_arg


def summary(report: dict) -> str:
    seen = report["pairs_with_seen_people"]
    trained = "unseen people" if seen == 0 else f"{seen} of {report['pairs']} pairs show people it trained on"
    return (f"{report['run']}: View 1 accuracy {report['view1_accuracy']:.3f} +- {report['view1_std']:.3f}, "
            f"ROC AUC {report['roc_auc']:.3f}, TAR@FAR=1e-2 {report['tar_at_far_1e-2']:.3f} "
            f"({trained if seen is not None else 'training people unknown'})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m research.evaluation", description=__doc__)
    p.add_argument("runs", nargs="+", type=Path, help="splitface-demo run directories")
    add_data_root_arg(p, help="LFW root (holding images/ and the View 1 pairs files); "
                              "default: $SPLITFACE_DATA, ~/.cache/splitface/lfw, ./data/lfw")
    p.add_argument("--limit", type=int, default=None, help="only the first N/2 matched and N/2 mismatched pairs")
    args = p.parse_args(argv)
    for run_dir in args.runs:
        report = evaluate_run(run_dir, args.data, args.limit)
        (run_dir / "view1.json").write_text(json.dumps(report, indent=2))
        print(summary(report), flush=True)


if __name__ == "__main__":
    main()
