"""Metric sinks, progress display and the end-of-run summary."""
