"""How long a stopped replica may take to finish its answers (Ray Serve's `graceful_shutdown_timeout_s`).

Ray Serve (2.60, serve/_private/replica.py) takes a stopped replica out of its callers' routing, waits
until none of its requests is ongoing (a streamed answer until its generator ends), awaits the class's
`__del__` and kills the process; whatever still runs `graceful_shutdown_timeout_s` after the stop is cut.
An answer runs through a Router and an LLM replica, either of which may be the one stopped, so both get
one grace, `answer_grace_s`: the longest answer a request gets without asking for more
(`llm.default_max_tokens`) at SLOW_TOKENS_PER_S, far below a loaded GPU's rate, plus START_MARGIN_S for
what precedes the first token. The builder (deployments/app.py) gives both the grace of the configured
`llm.default_max_tokens`; their decorators' default, ANSWER_GRACE_S, is that of the default config. A
request asking for more tokens may still be cut when its replica stops.
"""

from __future__ import annotations

import math

from ..config import LLMConfig

SLOW_TOKENS_PER_S = 5.0  # the slowest decode a long answer is allowed to have when its replica stops
START_MARGIN_S = 8  # before the first token: queueing, media, encoding, prefill, a caller not yet told of the stop
# the Router's own port (router_http_port) is drained inside its grace, with this much to spare for the rest
SHARED_PORT_MARGIN_S = 5


def answer_grace_s(max_tokens: int) -> int:
    """Seconds a replica that is stopped gives its answers in flight: an answer of `max_tokens` tokens at
    SLOW_TOKENS_PER_S, plus START_MARGIN_S."""
    return math.ceil(max_tokens / SLOW_TOKENS_PER_S) + START_MARGIN_S


def shared_port_drain_s(grace_s: float) -> float:
    """How long a Router that is stopped waits for the requests on its own port: inside `grace_s`."""
    return max(0.0, grace_s - SHARED_PORT_MARGIN_S)


# the grace of the default config (256 tokens: 60 s); the Router and LLM deployments' decorators use it
ANSWER_GRACE_S = answer_grace_s(LLMConfig.model_fields["default_max_tokens"].default)
