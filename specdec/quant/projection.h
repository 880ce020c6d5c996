// The integer-activation paths of a linear layer, one call for a whole fused projection (q|k|v,
// gate|up): x is rounded once for every part that reads it the same way, and one parallel loop runs over
// every part's output features. Built twice like qlinear.h (AVX2 in qlinear.cpp, AVX-512 VNNI in
// qlinear_vnni.cpp). Each output feature's tiles are the same whatever the parts beside it, so a part's
// results are bitwise those of calling it alone.
#pragma once
#include <algorithm>
#include <memory>
#include <vector>

#include "kernels.h"
#include "qlinear.h"
#include "tiles_prompt.h"

namespace {

// x as one kind of part reads it: rounded once (the constructor), then read by every feature's tiles.
struct Reader {
    virtual ~Reader() = default;
    // Feature j of `part` for rows [r0, r1) (row_tiles); y is the part's first output column.
    virtual void feature(const Part& part, int64_t j, int64_t r0, int64_t r1, float* y, int64_t ldy) const = 0;
    // Features [j0, j1) of `part` for rows [r0, r1): each as `feature` gives it.
    virtual void features(const Part& part, int64_t j0, int64_t j1, int64_t r0, int64_t r1, float* y,
                          int64_t ldy) const {
        for (int64_t j = j0; j < j1; ++j) feature(part, j, r0, r1, y, ldy);
    }
    // Prompts (tiles_prompt.h): the bytes feature j's weights take decoded, 0 where they are read as packed;
    // the decoding; and the feature from it.
    virtual int64_t decoded_bytes(const Part&) const { return 0; }
    virtual void decode(const Part&, int64_t, uint8_t*) const {}
    virtual void decoded_feature(const Part& part, int64_t j, const uint8_t*, int64_t r0, int64_t r1, float* y,
                                 int64_t ldy) const {
        feature(part, j, r0, r1, y, ldy);
    }
};

// int8 per G values, one float scale (and offset) per group of G (tiles_group_x.h): the file's 4-bit Q4_0 /
// Q4_1 and 8-bit Q5_0 / Q8_0 codes per 32, a requantized draft's 4- or 3-bit codes per 64.
template <int BITS, int G>
class A8Reader final : public Reader {
   public:
    A8Reader(const float* x, int64_t rows, int64_t k, bool offsets)
        : k_(k), xq_(buffer<int8_t>(rows * k)), sx_(buffer<float>(rows * (k / G))),
          sums_(offsets ? buffer<float>(rows * (k / G)) : nullptr) {
        quantize_rows<G>(x, rows, k, G, XOrder::ELEMENT, xq_.get(), sx_.get(), sums_.get());
    }

    void feature(const Part& p, int64_t j, int64_t r0, int64_t r1, float* y, int64_t ldy) const override {
        const int64_t groups = k_ / G;
        const void* c = (const uint8_t*)p.codes + j * row_bytes<BITS>(k_);
        const float* o = p.offset ? p.offset + j * groups : nullptr;
        row_tiles(r0, r1, [&](auto mt, int64_t r) {
            tile_a8<BITS, G, decltype(mt)::value>(xq_.get() + r * k_, sx_.get() + r * groups, k_,
                                                  sums_ ? sums_.get() + r * groups : nullptr, c,
                                                  p.scale + j * groups, o, y + r * ldy + j, ldy);
        });
    }

#ifdef __AVX512VNNI__
    // Four features at a time, then two (tile_a8_pairs: each feature's results as `feature` gives them);
    // four where rows are few (two multiply-add chains in flight), two where more rows give as many.
    void features(const Part& p, int64_t j0, int64_t j1, int64_t r0, int64_t r1, float* y,
                  int64_t ldy) const override {
        int64_t j = j0;
        // the run's first tile: the tiles prefetch the next one's, not their own
        const int64_t groups = k_ / G, first = std::min<int64_t>(j1 - j0, 4);
        prefetch_lines((const uint8_t*)p.codes + j0 * row_bytes<BITS>(k_), first * row_bytes<BITS>(k_));
        prefetch_lines(p.scale + j0 * groups, first * groups * 4);
        if (p.offset) prefetch_lines(p.offset + j0 * groups, first * groups * 4);
        if (r1 - r0 <= 4) j = pairs<2>(p, j, j1, r0, r1, y, ldy);
        j = pairs<1>(p, j, j1, r0, r1, y, ldy);
        if (j < j1) feature(p, j, r0, r1, y, ldy);
    }

    // Features j, j + 1, ... in groups of 2 * NP while a whole group fits before j1; returns the next.
    template <int NP>
    int64_t pairs(const Part& p, int64_t j, int64_t j1, int64_t r0, int64_t r1, float* y, int64_t ldy) const {
        const int64_t groups = k_ / G, bytes = row_bytes<BITS>(k_);
        for (; j + 2 * NP <= j1; j += 2 * NP) {
            const float* o = p.offset ? p.offset + j * groups : nullptr;
            row_tiles(r0, r1, [&](auto mt, int64_t r) {
                constexpr int MT = decltype(mt)::value;
                const int8_t* xq = xq_.get() + r * k_;
                const float *sx = sx_.get() + r * groups, *xs = sums_ ? sums_.get() + r * groups : nullptr;
                const uint8_t* c = (const uint8_t*)p.codes + j * bytes;
                const float* s = p.scale + j * groups;
                if constexpr (BITS == 3) tile_a8_wide3<MT, NP>(xq, sx, k_, xs, c, bytes, s, o, y + r * ldy + j, ldy);
                else tile_a8_pairs<BITS, G, MT, NP>(xq, sx, k_, xs, c, bytes, s, o, y + r * ldy + j, ldy);
            });
        }
        return j;
    }
#endif

   private:
    int64_t k_;
    std::unique_ptr<int8_t[]> xq_;
    std::unique_ptr<float[]> sx_, sums_;
};

// K-quant super-blocks (Q4_K: BITS 4, Q6_K: BITS 6): x rounded per 256 values to int8 (ACT 8, int4-a8)
// or int16 (ACT 16, int4-a16), then the tile of that rounding.
template <int BITS, int ACT>
class SuperReader final : public Reader {
    using XQ = std::conditional_t<ACT == 8, int8_t, int16_t>;
    static constexpr int G = BITS == 4 ? 32 : 16;
    // rows a tile takes: at 8 with int8 the integer sums and float accumulators no longer fit the 16
    // vector registers (a 256-row Q4_K projection ran 0.85x the rate of tiles of 6)
    static constexpr int kTile = ACT == 8 ? 6 : 8;

   public:
    // int_mins: Q4_K's offsets as integer minimums (ACT 8); offsets: float offsets otherwise
    SuperReader(const float* x, int64_t rows, int64_t k, bool offsets, bool int_mins)
        : k_(k), int_mins_(int_mins), xq_(buffer<XQ>(rows * k)), dx_(buffer<float>(rows * (k / 256))) {
        const int64_t groups = k / G;
        // int4-a8: each group's integer sum of the rounded x (Q6_K's unsigned6_correction, Q4_K's min_dot)
        if (ACT == 8 && (BITS == 6 || int_mins)) isums_ = buffer<int16_t>(rows * groups);
        // float offsets: under int4-a8 on the rounded x (quantize_rows); int4-a16's rounding is 256 times
        // finer and its offsets see the unrounded x
        if (offsets && !int_mins) sums_ = ACT == 8 ? buffer<float>(rows * groups) : group_sums<G>(x, rows, k);
        if constexpr (ACT == 8)
            quantize_rows<G>(x, rows, k, 256, BITS == 4 ? SUPER_X4 : SUPER_X6, xq_.get(), dx_.get(),
                             sums_.get(), isums_.get());
        else quantize_rows16(x, rows, k, xq_.get(), dx_.get());
    }

    void feature(const Part& p, int64_t j, int64_t r0, int64_t r1, float* y, int64_t ldy) const override {
        feature_at(p, j, r0, r1, y, ldy, nullptr);
    }

    // Q4_K under int8: 8 features at a time, their minimums' terms for every row first (min_dot8: the
    // same floats as min_dot, each operation for 8 features), then each feature's tiles.
    void features(const Part& p, int64_t j0, int64_t j1, int64_t r0, int64_t r1, float* y,
                  int64_t ldy) const override {
        const int64_t supers = k_ / 256, groups = k_ / G;
        int64_t j = j0;
        if (int_mins_ && supers <= kMins8Supers && r1 - r0 <= kPromptRows)
            for (; j + 8 <= j1; j += 8) {
                float less8[kPromptRows * 8];
                min_dot8(isums_.get() + r0 * groups, groups, dx_.get() + r0 * supers, supers, p.mins + j * groups,
                         p.dmin + j * supers, r1 - r0, less8);
                for (int f = 0; f < 8; ++f) feature_at(p, j + f, r0, r1, y, ldy, less8 + f);
            }
        for (; j < j1; ++j) feature_at(p, j, r0, r1, y, ldy, nullptr);
    }

#ifndef __AVX512VNNI__
    // Q6_K under int8 (tiles_prompt.h); the rest read their codes packed
    int64_t decoded_bytes(const Part&) const override { return ACT == 8 && BITS == 6 ? k_ / 256 * kDecoded6 : 0; }

    void decode(const Part& p, int64_t j, uint8_t* w) const override {
        if constexpr (ACT == 8 && BITS == 6)
            decode_super6((const uint8_t*)p.codes + j * row_bytes<BITS>(k_), p.sub + j * (k_ / G), k_ / 256, w);
    }

    void decoded_feature(const Part& p, int64_t j, const uint8_t* w, int64_t r0, int64_t r1, float* y,
                         int64_t ldy) const override {
        if constexpr (ACT == 8 && BITS == 6)
            each_tile<kTile>(p, j, r0, r1, y, ldy, [&](auto mt, const XQ* xq, const float* dx, const float* xs,
                                                       const int16_t* is, const float* dsup, const float* o, float* yr,
                                                       const float* less) {
                prompt_tile6<decltype(mt)::value>(xq, dx, k_, xs, is, w, dsup, o, yr, ldy, less);
            });
        else feature(p, j, r0, r1, y, ldy);
    }
#endif

   private:
    // Feature j's rows [r0, r1); less8: Q4_K's minimums' terms of rows r0.. at stride 8, or null to compute.
    void feature_at(const Part& p, int64_t j, int64_t r0, int64_t r1, float* y, int64_t ldy, const float* less8) const {
        const void* c = (const uint8_t*)p.codes + j * row_bytes<BITS>(k_);
        const int8_t* sub = p.sub + j * (k_ / G);
        each_tile<kTile>(p, j, r0, r1, y, ldy, [&](auto mt, const XQ* xq, const float* dx, const float* xs,
                                                   const int16_t* is, const float* dsup, const float* o, float* yr,
                                                   const float* less) {
            constexpr int MT = decltype(mt)::value;
            if constexpr (ACT == 8) tile_super<BITS, MT>(xq, dx, k_, xs, is, c, sub, dsup, o, yr, ldy, less);
            else tile_a16<BITS, MT>(xq, dx, k_, xs, c, sub, dsup, o, yr, ldy);
        }, less8);
    }

    // Feature j's rows [r0, r1) in tiles: tile(MT, x, dx, group sums, integer group sums, dsup, offsets, y,
    // Q4_K's integer minimums or null); less8 (row r0 + i's at less8[i * 8]): those minimums given.
    template <int T, class Tile>
    void each_tile(const Part& p, int64_t j, int64_t r0, int64_t r1, float* y, int64_t ldy, Tile tile,
                   const float* less8 = nullptr) const {
        const int64_t supers = k_ / 256, groups = k_ / G;
        const float* o = int_mins_ || !p.offset ? nullptr : p.offset + j * groups;
        const float* dsup = p.dsup + j * supers;
        row_tiles<T>(r0, r1, [&](auto mt, int64_t r) {
            constexpr int MT = decltype(mt)::value;
            const int16_t* is = isums_ ? isums_.get() + r * groups : nullptr;
            const float* dx = dx_.get() + r * supers;
            float less[MT];
            for (int i = 0; less8 && i < MT; ++i) less[i] = less8[(r - r0 + i) * 8];
            if (int_mins_ && !less8) mins_of<MT>(p, j, is, dx, less);
            tile(mt, xq_.get() + r * k_, dx, sums_ ? sums_.get() + r * groups : nullptr, is, dsup, o,
                 y + r * ldy + j, int_mins_ ? less : nullptr);
        });
    }

    // Q4_K's minimums' term of feature j for MT rows (is, dx: the first row's), subtracted as the tile finishes.
    template <int MT>
    void mins_of(const Part& p, int64_t j, const int16_t* is, const float* dx, float* less) const {
        const int64_t supers = k_ / 256, groups = k_ / G;
        for (int i = 0; i < MT; ++i)
            less[i] = min_dot(is + i * groups, p.mins + j * groups, p.dmin + j * supers, dx + i * supers, supers);
    }

    int64_t k_;
    bool int_mins_;
    std::unique_ptr<XQ[]> xq_;
    std::unique_ptr<float[]> dx_, sums_;
    std::unique_ptr<int16_t[]> isums_;
};

// The reader a part needs, or null for a layout the integer paths do not take.
inline std::unique_ptr<Reader> make_reader(const Part& p, const float* x, int64_t rows, int64_t k) {
    if (p.dense || (p.act != 8 && p.act != 16) || k % 32) return nullptr;
    const bool offsets = p.offset != nullptr;
    if (p.sub) {  // K-quant super-blocks: one exact integer sum per 256 (or 128) values
        if (k % 256 || !p.dsup || (p.mins && (p.act != 8 || !p.dmin))) return nullptr;
        const bool mins = p.mins != nullptr;
        if (p.bits == 4 && p.group == 32)
            return p.act == 8 ? std::unique_ptr<Reader>(new SuperReader<4, 8>(x, rows, k, offsets, mins))
                              : std::unique_ptr<Reader>(new SuperReader<4, 16>(x, rows, k, offsets, false));
        if (p.bits == 6 && p.group == 16 && !mins)
            return p.act == 8 ? std::unique_ptr<Reader>(new SuperReader<6, 8>(x, rows, k, offsets, false))
                              : std::unique_ptr<Reader>(new SuperReader<6, 16>(x, rows, k, offsets, false));
        return nullptr;
    }
    if (p.act != 8 || k % p.group) return nullptr;
    if (p.group == 32 && p.bits == 4) return std::unique_ptr<Reader>(new A8Reader<4, 32>(x, rows, k, offsets));
    if (p.group == 32 && p.bits == 8) return std::unique_ptr<Reader>(new A8Reader<8, 32>(x, rows, k, offsets));
    if (p.group == 64 && p.bits == 4) return std::unique_ptr<Reader>(new A8Reader<4, 64>(x, rows, k, offsets));
    if (p.group == 64 && p.bits == 3) return std::unique_ptr<Reader>(new A8Reader<3, 64>(x, rows, k, offsets));
    return nullptr;
}

// Whether two parts read x the same way (one rounding serves both).
inline bool same_reading(const Part& a, const Part& b) {
    return a.bits == b.bits && a.group == b.group && a.act == b.act && !a.sub == !b.sub && !a.mins == !b.mins &&
           !a.offset == !b.offset;
}

// run(p, a, b) for each run [a, b) of part p's features (numbered within the part) among the projection's
// features [j0, j1).
template <class Run>
inline void part_runs(const std::vector<int64_t>& start, int64_t j0, int64_t j1, Run run) {
    for (int64_t j = j0, p = 0; j < j1;) {
        while (j >= start[p + 1]) ++p;
        const int64_t e = std::min(j1, start[p + 1]);
        run(p, j - start[p], e - start[p]);
        j = e;
    }
}

// A prompt's rows through every feature (tiles_prompt.h): each thread takes a tile of features, decodes
// their weights once (or reads them packed, where a reader does not decode) and runs every row through
// them, kPromptSpan rows at a time.
inline void run_prompt(const std::vector<const Reader*>& readers, const Part* parts, const std::vector<int64_t>& start,
                       int64_t rows, int64_t k, float* y, int64_t ldy, int threads) {
    const int64_t num_parts = (int64_t)readers.size(), n = start[num_parts];
    int64_t slot = 0, code_bytes = 0;  // a feature's decoded bytes (the most any part needs), its packed bytes
    for (int64_t p = 0; p < num_parts; ++p) {
        slot = std::max(slot, (readers[p]->decoded_bytes(parts[p]) + 63) / 64 * 64);
        code_bytes = std::max(code_bytes, k * parts[p].bits / 8);
    }
    const int64_t f = prompt_features(slot ? slot : code_bytes), tiles = (n + f - 1) / f;
#pragma omp parallel num_threads(threads)
    {
        std::unique_ptr<uint8_t[]> w = buffer<uint8_t>(slot * f);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t j0 = t * f, j1 = std::min(j0 + f, n);
            if (slot)
                part_runs(start, j0, j1, [&](int64_t p, int64_t a, int64_t b) {
                    for (int64_t j = a; j < b; ++j)
                        readers[p]->decode(parts[p], j, w.get() + (start[p] + j - j0) * slot);
                });
            for (int64_t r = 0; r < rows; r += kPromptSpan) {
                const int64_t r1 = std::min(r + kPromptSpan, rows);
                part_runs(start, j0, j1, [&](int64_t p, int64_t a, int64_t b) {
                    if (!readers[p]->decoded_bytes(parts[p])) {
                        readers[p]->features(parts[p], a, b, r, r1, y + start[p], ldy);
                        return;
                    }
                    for (int64_t j = a; j < b; ++j)
                        readers[p]->decoded_feature(parts[p], j, w.get() + (start[p] + j - j0) * slot, r, r1,
                                                    y + start[p], ldy);
                });
            }
        }
    }
}

// y[:, start(p) + j] for every feature j of every part p, parts side by side from column 0. Returns 0, or
// -1 on a part the integer paths do not take (nothing is written then).
inline int run_projection(const float* x, int64_t rows, int64_t k, const Part* parts, int64_t num_parts, float* y,
                          int64_t ldy, int threads) {
    std::vector<std::unique_ptr<Reader>> owned;
    std::vector<const Reader*> readers(num_parts);
    std::vector<int64_t> start(num_parts + 1, 0);
    for (int64_t p = 0; p < num_parts; ++p) {
        for (int64_t q = 0; q < p && !readers[p]; ++q)
            if (same_reading(parts[p], parts[q])) readers[p] = readers[q];
        if (!readers[p]) {
            owned.push_back(make_reader(parts[p], x, rows, k));
            if (!owned.back()) return -1;
            readers[p] = owned.back().get();
        }
        start[p + 1] = start[p] + parts[p].n;
    }
    if (rows >= kPromptRows) {
        run_prompt(readers, parts, start, rows, k, y, ldy, threads);
        return 0;
    }
    // rows in blocks whose x (int16 or int8) stays in L2; features in chunks on demand, a multiple of 8
    const bool wide = std::any_of(parts, parts + num_parts, [](const Part& p) { return p.act == 16; });
    const int64_t n = start[num_parts], block = row_block(k, wide ? 2 : 1);
    const int64_t chunk = (chunk_size(n, threads, 4) + 7) / 8 * 8, chunks = (n + chunk - 1) / chunk;
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
        const int64_t r1 = std::min(r0 + block, rows);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; ++c)
            part_runs(start, c * chunk, std::min(n, (c + 1) * chunk), [&](int64_t p, int64_t a, int64_t b) {
                readers[p]->features(parts[p], a, b, r0, r1, y + start[p], ldy);
            });
    }
    return 0;
}

}  // namespace

// run_projection built for AVX-512 VNNI (qlinear_vnni.cpp); called only where the CPU has it.
int qlinear_parts_vnni(const float* x, int64_t rows, int64_t k, const Part* parts, int64_t num_parts, float* y,
                       int64_t ldy, int threads);
