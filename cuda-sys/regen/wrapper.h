/* The one header cuda-sys binds: the CUDA driver API. */
#include <cuda.h>
