// The integer-activation paths of qlinear.h built with AVX-512 VNNI (the build compiles this file alone
// with -mavx512f -mavx512bw -mavx512vl -mavx512vnni); qlinear.cpp calls them only where the CPU has it.
#include "qlinear.h"

int qlinear_int_vnni(const float* x, int64_t rows, int64_t k, int bits, int group, const void* codes,
                     const float* scale, const float* offset, int64_t n, float* y, int64_t ldy, int threads, int act,
                     const int8_t* sub, const float* dsup, const uint8_t* mins, const float* dmin) {
    return run_int(x, rows, k, bits, group, codes, scale, offset, n, y, ldy, threads, act, sub, dsup, mins, dmin);
}
