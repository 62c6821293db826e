/* The C kernels of RowNorm steps on CPU (dit_train/optim/native_rownorm.py), in fp32 and fp64:
 * rownorm_passes.inc (the momentum and update passes) and power_iteration.inc (the spectral scale's matrix-vector
 * products), both spread over threads by row_blocks.h. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "row_blocks.h"

#define T float
#define SQRT sqrtf
#define NAME(x) x##_f32
#include "rownorm_passes.inc"
#include "power_iteration.inc"
#undef T
#undef SQRT
#undef NAME

#define T double
#define SQRT sqrt
#define NAME(x) x##_f64
#include "rownorm_passes.inc"
#include "power_iteration.inc"
#undef T
#undef SQRT
#undef NAME
