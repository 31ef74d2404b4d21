"""`refusion serve`: an OpenAI-compatible HTTP server with continuous batching and a live web view.

app.py      HTTP layer (Starlette): routes, limits, OpenAI shapes, SSE
engine.py   the engine loop: one thread owns the model; requests join and leave between steps
params.py   a request's decoder and its validated parameters
schemas.py  request bodies -> dataclasses, strict checks, OpenAI error objects
text.py     committed tokens -> text in position order, stop strings
metrics.py  Prometheus metrics
static/     the web page served at /
"""
