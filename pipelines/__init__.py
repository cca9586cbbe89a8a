"""Spark sources, sinks and transforms of DejaQ."""
