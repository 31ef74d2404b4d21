"""`refusion serve`: an OpenAI-compatible HTTP server with continuous batching and a live web view.

app.py      HTTP layer (Starlette): routes, limits, OpenAI shapes, SSE
connection.py  below the app: the listening socket, uvicorn's h11 with a header timeout
engine.py   the engine loop: one thread owns the model; requests join and leave between steps
budget.py   what one request may cost (tokens per row), checked before it is admitted
params.py   a request's decoder and its validated parameters
schemas.py  request bodies -> dataclasses, strict checks, OpenAI error objects
text.py     committed tokens -> text in position order, stop strings
metrics.py  Prometheus metrics
static/     the web page served at /
"""
