"""`kvpool serve`: the OpenAI-compatible server on the engine (FastAPI + uvicorn), its
Prometheus metrics, and the load generator of `kvpool bench serve`."""
