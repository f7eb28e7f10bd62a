"""Names of the weight formats the kernels bind (minserve/models/weights.py's descriptors carry
one). They live here, beside the kernels that check them, so a kernel never imports the model
layer to learn what "dense" is called."""

DENSE = "dense"   # data is the [out, in] weight matrix itself, in data.dtype
