"""Face verification on LFW View 1 (people a model never saw), for every training mode and for reference
recognizers: `python -m edge_server.evaluation RUN_DIR... --data LFW`."""
from .run import evaluate_run
from .verification import Pairs, evaluate_embedder, verification_report, view1_pairs

__all__ = ["Pairs", "evaluate_embedder", "evaluate_run", "verification_report", "view1_pairs"]
