"""Target features: online (inside the training step), offline (to disk), disaggregated (p2p)."""

from dflash2.capture.features import extract_features

__all__ = ["extract_features"]
