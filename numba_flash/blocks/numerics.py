"""Constants of the online softmax (section 3.6.4) and how the kernels read their dtypes."""
from numba.cuda import types

LOG2E = 1.4426950408889634  # exp(x) = exp2(x · log2 e): the kernels' exponentials are ex2
LN2 = 0.6931471805599453  # back from base-2 logsumexp to the natural-log L the API returns

# How a kernel reads and writes the input dtype. bfloat16 travels as uint16 bit patterns
# (Numba has no bfloat16 array type) and is widened by a shift through an aliased shared word.
STORAGE = {"float32": types.float32, "float16": types.float16, "bfloat16": types.uint16}

# Only the flags that cannot change -inf/nan semantics: masking relies on exact -inf.
FASTMATH = {"contract", "arcp", "afn"}
