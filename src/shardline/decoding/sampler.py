"""Pick the next token from a logits row: greedy, or temperature with top-k / top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shardline.config import SamplingConfig


@dataclass(frozen=True)
class Choice:
    """What the end of a pipeline sends back for one step: a token and its log-probability under
    the model's own distribution (raw logits, temperature 1); the logits row only for a stream
    that asked for it (SamplingConfig.logprobs > 0): ~200 KB per token instead of ~100 B."""

    token: int
    logprob: float
    logits: np.ndarray | None = field(default=None, compare=False, repr=False)  # [vocab] f32


def top_logprobs(logits: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The n most likely tokens and their log-probabilities (temperature 1), most likely first."""
    x = logits.astype(np.float64)
    logp = x - x.max() - np.log(np.exp(x - x.max()).sum())
    top = np.argpartition(-logp, min(n, len(logp)) - 1)[:n]
    top = top[np.argsort(-logp[top], kind="stable")]
    return [(int(t), float(logp[t])) for t in top]


def log_softmax_at(logits: np.ndarray, token: int) -> float:
    x = logits.astype(np.float64)
    m = x.max()
    return float(x[token] - m - np.log(np.exp(x - m).sum()))


class Sampler:
    def __init__(self, cfg: SamplingConfig) -> None:
        self.cfg = cfg
        self._rng = np.random.default_rng(cfg.seed)

    def choose(self, logits: np.ndarray) -> Choice:
        token = self(logits)
        return Choice(token, log_softmax_at(logits, token))

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
