"""The OpenAI-compatible HTTP server (python -m engine.serve). `app.build_app` wires it up:
schemas (request bodies) -> inputs (checks, prompt ids, SamplingParams) -> completions /
chat_completions (responses and stream chunks) over streaming / serving (engine requests,
SSE, disconnects); errors, logprobs and metrics are shared by both endpoints."""
