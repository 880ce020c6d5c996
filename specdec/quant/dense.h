#pragma once
#include "tiles_common.h"

namespace {

// ---- dense float32 weights (precision float32 on CPU) ------------------------------------------------
// A tile of MT rows x NF output features: each weight vector is loaded once for MT rows and each x vector
// once for NF features (12 FMAs per 7 loads at 4 x 3), which is what makes many rows cheaper per row
// than MKL's sgemm here. Each output keeps one 8-lane accumulator over k in order, then a fixed
// horizontal sum: the same arithmetic whatever the tile, so rows are batch-invariant by construction.
template <int MT, int NF>
inline void dense_tile(const float* x, int64_t k, const float* w, float* y, int64_t ldy) {
    __m256 acc[MT][NF];
    for (int r = 0; r < MT; ++r)
        for (int f = 0; f < NF; ++f) acc[r][f] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
        __m256 wv[NF];
        for (int f = 0; f < NF; ++f) wv[f] = _mm256_loadu_ps(w + f * k + i);
        for (int r = 0; r < MT; ++r) {
            const __m256 xv = _mm256_loadu_ps(x + r * k + i);
            for (int f = 0; f < NF; ++f) acc[r][f] = _mm256_fmadd_ps(wv[f], xv, acc[r][f]);
        }
    }
    for (int r = 0; r < MT; ++r)
        for (int f = 0; f < NF; ++f) y[r * ldy + f] = hsum(acc[r][f]);
}

template <int NF>
inline void dense_rows(const float* x, int64_t rows, int64_t k, const float* w, float* y, int64_t ldy) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) dense_tile<4, NF>(x + r * k, k, w, y + r * ldy, ldy);
    for (; r < rows; ++r) dense_tile<1, NF>(x + r * k, k, w, y + r * ldy, ldy);
}

void dense(const float* x, int64_t rows, int64_t k, const float* w, int64_t n, float* y, int64_t ldy,
           int threads) {
    constexpr int NF = 3;
    const int64_t blocks = (n + NF - 1) / NF;
#pragma omp parallel for num_threads(threads) schedule(dynamic, chunk_size(blocks, threads) / 2)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t j = b * NF;
        if (j + NF <= n) dense_rows<NF>(x, rows, k, w + j * k, y + j, ldy);
        else
            for (int64_t jj = j; jj < n; ++jj) dense_rows<1>(x, rows, k, w + jj * k, y + jj, ldy);
    }
}

}  // namespace
