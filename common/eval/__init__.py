"""Evaluation: classification, topic and clustering scores."""
