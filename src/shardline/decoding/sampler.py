"""Pick the next token from a logits row: greedy, or temperature with top-k / top-p, seeded."""

from __future__ import annotations

import numpy as np

from shardline.config import SamplingConfig


class Sampler:
    def __init__(self, cfg: SamplingConfig) -> None:
        self.cfg = cfg
        self._rng = np.random.default_rng(cfg.seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.cfg.greedy:
            return int(np.argmax(logits))
        return int(self._rng.choice(logits.shape[-1], p=self.probabilities(logits)))

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution sampled from, after temperature, top-k and top-p (nucleus) filtering."""
        z = logits.astype(np.float64) / self.cfg.temperature
        if self.cfg.top_k and self.cfg.top_k < z.shape[-1]:
            kth = np.partition(z, -self.cfg.top_k)[-self.cfg.top_k]
            z = np.where(z < kth, -np.inf, z)
        p = np.exp(z - z.max())
        p /= p.sum()
        if self.cfg.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            cut = int(np.searchsorted(cum, self.cfg.top_p)) + 1
            keep = np.zeros_like(p, dtype=bool)
            keep[order[:cut]] = True
            p = np.where(keep, p, 0.0)
            p /= p.sum()
        return p
