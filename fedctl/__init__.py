"""fedctl: a federated-learning cluster for text."""

__version__ = "0.1.0"
