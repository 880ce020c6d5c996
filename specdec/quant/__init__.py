"""The kernels layer, below `models/`: the AVX2 C++ kernels built on first use (`kernel`, their C ABI in
`kernels.h`), the layer loop in one call (`decoder`), weight-only quantized linear layers (GGUF blocks
carried into packed integer codes with per-group scales and offsets: `gguf_blocks`, `packed`), and the
batch-invariant building blocks a model is made of (`layers`: linear and row alignment; `attention`:
paged attention), whose kernel paths a `KernelOptions` (`options`) selects."""
