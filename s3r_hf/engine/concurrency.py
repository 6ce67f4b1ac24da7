"""The KV-aware AIMD concurrency limit of the paper's Appendix B.2."""

from __future__ import annotations

from transformers.utils import logging

from s3r_hf.config import S3RConfig

logger = logging.get_logger(__name__)


class AIMDConcurrency:
    """`C_{j+1} = clip(C_j + δ if u < u_low; ⌊β C_j⌋ if u > u_high or O > O_th; else C_j)`.

    `u` is the KV-pool utilisation after a step and `O` the number of paused requests waiting for restore. The
    limit starts at `C_max`; `trace` holds it after every step, the starting limit first.
    """

    def __init__(self, config: S3RConfig) -> None:
        self.config = config
        self.limit = config.concurrency_max
        self.trace: list[int] = [self.limit]

    def update(self, utilization: float, restore_backlog: int) -> int:
        cfg = self.config
        if utilization > cfg.utilization_high or restore_backlog > cfg.restore_backlog_threshold:
            limit = int(cfg.concurrency_backoff * self.limit)
        elif utilization < cfg.utilization_low:
            limit = self.limit + cfg.concurrency_step
        else:
            limit = self.limit
        limit = max(cfg.concurrency_min, min(cfg.concurrency_max, limit))
        if limit < self.limit:
            logger.info("concurrency limit %d -> %d (KV pool %.0f%% used, %d paused requests waiting)",
                        self.limit, limit, 100 * utilization, restore_backlog)
        self.limit = limit
        self.trace.append(self.limit)
        return self.limit
