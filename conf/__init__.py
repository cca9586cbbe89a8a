"""Configuration and the table contract: Spark-free, shared by pipelines, jobs and broker."""
