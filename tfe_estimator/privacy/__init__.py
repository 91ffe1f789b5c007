"""Differential privacy inside the secure sum (`dp`: `DistributedDP`, `dp_epsilon`).

Example::

    from tfe_estimator.privacy.dp import DistributedDP
    dp = DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.1)
"""
__all__ = []
