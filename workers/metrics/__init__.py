"""Metric sinks of the metrics role: JSON Lines, TensorBoard, Weights & Biases (step files), Prometheus (gauges)."""
