"""The OpenAI-compatible server: `protocol` (pydantic request / response models), `serving` (requests
-> engine -> responses), `app` (FastAPI routes, `gemma4-serve`). Needs the `serve` extra."""
