"""`mlx-specdec serve`: the OpenAI-compatible HTTP API (app.py), its request checks (requests.py) and
the one generation thread (worker.py)."""
