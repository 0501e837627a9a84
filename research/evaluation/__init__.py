"""Face verification on LFW View 1 (people a model never saw), for every training mode and for reference
recognizers: `splitface-research evaluate RUN_DIR... --data LFW`."""
from research.evaluation.run import evaluate_run
from research.evaluation.verification import Pairs, evaluate_embedder, verification_report, view1_pairs

__all__ = ["Pairs", "evaluate_embedder", "evaluate_run", "verification_report", "view1_pairs"]
