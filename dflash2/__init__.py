"""dflash2: train DFlash and DFlash 2 speculative-decoding drafts, and export them for serving."""

__version__ = "0.1.0"
