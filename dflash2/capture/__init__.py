"""Target features: online (inside the training step), offline (to disk), disaggregated (p2p)."""

from dflash2.capture.features import capture_layer_outputs, decoder_layers, target_features

__all__ = ["capture_layer_outputs", "decoder_layers", "target_features"]
