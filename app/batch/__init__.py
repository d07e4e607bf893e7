"""Offline batch jobs: a file of OpenAI chat-completion bodies in, sharded JSONL answers out.

`python -m app.batch --input requests.jsonl --output out/` (or under `ray job submit`) runs the
serving stages as Ray core actor pools: media preparation (CPU), the vision encoder (the same
`EncoderService`/`GraphManager` as the VisionEncoder deployment) and the LLM (the same `Engine`).
Modules: `config` (pydantic), `io` (input rows, atomic shards, resume), `media` (file paths under a
root), `workers` (the stage classes, no Ray), `pool` (autoscaled actor pools), `job` (the driver),
`progress` (progress line and end report).
"""
