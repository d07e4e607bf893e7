"""A media item as a request names it. Its own module so that media preparation (and the
MediaPreprocessor replicas that unpickle it) need nothing from the API or LLM modules."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MediaOptions:
    """A request's own preprocessing settings (`mm_processor_kwargs`), already checked against the
    server's limits (app/api/schemas.py): the smart-resize bounds of its images and video frames, and
    the frames sampled per second of its videos. None: the server's setting."""

    min_pixels: int | None = None
    max_pixels: int | None = None
    fps: float | None = None

    def pixels(self, lo: int, hi: int) -> tuple[int, int]:
        """The resize bounds, the server's (`lo`, `hi`) where the request gives none."""
        return (lo if self.min_pixels is None else self.min_pixels), (hi if self.max_pixels is None else self.max_pixels)


@dataclass
class MediaRef:
    kind: str  # what the client said: "image" | "video"
    url: str
    param: str  # where it sits in the request, for error messages
    options: MediaOptions | None = None
