"""The encoder replica's work, independent of Ray: load the tower, capture graphs, encode."""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..config import AppConfig
from ..llm.engine import resolve_dtype
from .graphs import GraphManager, GraphSettings, VisionItem
from .loading import load_vision_model
from .tower import VisionTower

log = logging.getLogger(__name__)

EncodedItem = tuple[torch.Tensor, list[torch.Tensor]]  # (main, deepstack) on the CPU


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


class EncoderService:
    def __init__(self, cfg: AppConfig, checkpoint: str):
        enc = cfg.encoder
        device = pick_device(cfg.device)
        dtype = resolve_dtype(enc.dtype, torch.device(device))
        tower = VisionTower(load_vision_model(checkpoint, dtype, device))
        budgets = enc.token_budgets or GraphSettings.power_of_two_budgets(enc.min_budget, enc.max_budget,
                                                                                enc.budget_steps_per_octave)
        self.manager = GraphManager(tower, GraphSettings(budgets, enc.max_items_per_batch, enc.max_frames_per_batch,
                                                         enc.cuda_graphs, enc.autotune))
        self.manager.capture()
        log.info("vision encoder ready on %s (%s), budgets %s, graphs %s", device, dtype, self.manager.budgets,
                 sorted(self.manager.graphs) or "none captured")

    def encode(self, items: list[tuple[np.ndarray, tuple[int, int, int]]]) -> list[EncodedItem]:
        outs = self.manager.encode([VisionItem(torch.from_numpy(px), tuple(grid)) for px, grid in items])
        # Each item gets its own storage: a view would ship the whole batch to every request.
        return [(o.main.to("cpu", copy=True), [d.to("cpu", copy=True) for d in o.deepstack]) for o in outs]

    def stats(self) -> dict:
        return {**self.manager.stats.as_dict(), "budgets": self.manager.budgets,
                "captured": sorted(self.manager.graphs), "capture_seconds": self.manager.capture_seconds,
                "autotune": self.manager.autotune_table}
