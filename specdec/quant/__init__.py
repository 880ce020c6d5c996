"""Weight-only quantized linear layers: GGUF blocks carried into packed integer codes with per-group
scales and offsets (`gguf_blocks`, `packed`), run by an AVX2 kernel built on first use (`kernel`)."""
