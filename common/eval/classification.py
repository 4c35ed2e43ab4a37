"""Classification scores shared by the workers, the baselines and the benchmarks."""

from __future__ import annotations

import numpy as np


# hand-written: NaN for empty splits and accuracy as one np.mean; macro-F1 is scikit-learn's
def classification_metrics(y_true: np.ndarray, y_pred: np.ndarray) -> dict[str, float]:
    """Accuracy and macro-F1.

    Macro-F1 averages over the classes present in ``y_true`` or ``y_pred`` (scikit-learn's
    default): a worker whose test split holds no positives and that predicts none scores 1.0,
    not a meaningless 0.5 from a class it never saw.
    """
    # Imported here: scikit-learn costs a process 0.7 s, and a master imports this module
    # with its family but scores nothing unless it trains the baselines.
    from sklearn.metrics import f1_score

    if len(y_true) == 0:
        return {"accuracy": float("nan"), "macro_f1": float("nan")}
    return {
        "accuracy": float(np.mean(y_true == y_pred)),
        "macro_f1": float(f1_score(y_true, y_pred, average="macro", zero_division=0)),
    }
