"""Signal processing: DFT, STFT, window functions, mel weight matrix."""

from __future__ import annotations
