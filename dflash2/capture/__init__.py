"""Target features: online (inside the training step), offline (to disk), disaggregated (p2p)."""

from dflash2.capture.features import target_features

__all__ = ["target_features"]
