"""A media item as a request names it. Its own module so that media preparation (and the
MediaPreprocessor replicas that unpickle it) need nothing from the API or LLM modules."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MediaRef:
    kind: str  # what the client said: "image" | "video"
    url: str
    param: str  # where it sits in the request, for error messages
