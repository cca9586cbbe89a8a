"""The broker's HTTP surface: the FastAPI app, its routers and their dependencies, the
hot path for lease and ack, access control and API keys, and metrics."""
