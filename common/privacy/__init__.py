"""Privacy mechanisms: differential privacy for the gradient-trained families
(:mod:`common.privacy.dp`: record-level DP-SGD on the workers, client-level DP-FedAvg, the
accountant) and iFTM's Laplace mechanism for the topic models (:mod:`common.privacy.laplace`).
"""

from common.privacy.laplace import laplace_noise, privatize

__all__ = ["laplace_noise", "privatize"]
