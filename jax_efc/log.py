"""The "jax_efc" logger, and each message on it logged once per process (a fallback's reason,
a cache that cannot be used), whichever layer it comes from."""

from __future__ import annotations

import logging

__all__ = ["logger", "log_once"]

logger = logging.getLogger("jax_efc")
_logged: set[str] = set()


def log_once(level: int, message: str) -> None:
    """Log ``message`` on the "jax_efc" logger the first time it comes."""
    if message not in _logged:
        _logged.add(message)
        logger.log(level, "jax_efc: %s", message)
