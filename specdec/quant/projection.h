// The integer-activation paths of a linear layer, one call for a whole fused projection (q|k|v,
// gate|up): x is rounded once for every part that reads it the same way, and one parallel loop runs over
// every part's output features. Built twice like qlinear.h (AVX2 in qlinear.cpp, AVX-512 VNNI in
// qlinear_vnni.cpp). Each output feature's tiles are the same whatever the parts beside it, so a part's
// results are bitwise those of calling it alone.
#pragma once
#include <memory>
#include <vector>

#include "kernels.h"
#include "qlinear.h"

namespace {

// x as one kind of part reads it: rounded once (the constructor), then read by every feature's tiles.
struct Reader {
    virtual ~Reader() = default;
    // Feature j of `part` for rows [r0, r1) (row_tiles); y is the part's first output column.
    virtual void feature(const Part& part, int64_t j, int64_t r0, int64_t r1, float* y, int64_t ldy) const = 0;
};

// int8 per 32 values, one float scale per group (Q4_0-like 4-bit codes, 8-bit codes: Q5_0, Q8_0).
template <int BITS, int G>
class A8Reader final : public Reader {
   public:
    A8Reader(const float* x, int64_t rows, int64_t k, bool offsets)
        : k_(k), xq_(buffer<int8_t>(rows * k)), sx_(buffer<float>(rows * (k / 32))),
          sums_(offsets ? buffer<float>(rows * (k / G)) : nullptr) {
        quantize_rows<G>(x, rows, k, 32, XOrder::ELEMENT, xq_.get(), sx_.get(), sums_.get());
    }

    void feature(const Part& p, int64_t j, int64_t r0, int64_t r1, float* y, int64_t ldy) const override {
        const int64_t blocks = k_ / 32, groups = k_ / G;
        const void* c = (const uint8_t*)p.codes + j * row_bytes<BITS>(k_);
        const float* o = p.offset ? p.offset + j * groups : nullptr;
        row_tiles(r0, r1, [&](auto mt, int64_t r) {
            tile_a8<BITS, G, decltype(mt)::value>(xq_.get() + r * k_, sx_.get() + r * blocks, k_,
                                                  sums_ ? sums_.get() + r * groups : nullptr, c,
                                                  p.scale + j * groups, o, y + r * ldy + j, ldy);
        });
    }

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
            quantize_rows<G>(x, rows, k, 256, BITS == 4 ? SUPER_X4 : XOrder::ELEMENT, xq_.get(), dx_.get(),
                             sums_.get(), isums_.get());
        else quantize_rows16(x, rows, k, xq_.get(), dx_.get());
    }

    void feature(const Part& p, int64_t j, int64_t r0, int64_t r1, float* y, int64_t ldy) const override {
        const int64_t supers = k_ / 256, groups = k_ / G;
        const void* c = (const uint8_t*)p.codes + j * row_bytes<BITS>(k_);
        const float* o = int_mins_ || !p.offset ? nullptr : p.offset + j * groups;
        const int8_t* sub = p.sub + j * groups;
        const float* dsup = p.dsup + j * supers;
        row_tiles(r0, r1, [&](auto mt, int64_t r) {
            constexpr int MT = decltype(mt)::value;
            const float* xs = sums_ ? sums_.get() + r * groups : nullptr;
            const int16_t* is = isums_ ? isums_.get() + r * groups : nullptr;
            const XQ* xq = xq_.get() + r * k_;
            const float* dx = dx_.get() + r * supers;
            if constexpr (ACT == 8) {
                tile_super<BITS, MT>(xq, dx, k_, xs, is, c, sub, dsup, o, y + r * ldy + j, ldy);
                if (int_mins_)
                    for (int i = 0; i < MT; ++i)
                        y[(r + i) * ldy + j] -= min_dot(is + i * groups, p.mins + j * groups, p.dmin + j * supers,
                                                        dx + i * supers, supers);
            } else
                tile_a16<BITS, MT>(xq, dx, k_, xs, c, sub, dsup, o, y + r * ldy + j, ldy);
        });
    }

   private:
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
    if (p.act != 8 || p.group != 32) return nullptr;
    if (p.bits == 4) return std::unique_ptr<Reader>(new A8Reader<4, 32>(x, rows, k, offsets));
    if (p.bits == 8) return std::unique_ptr<Reader>(new A8Reader<8, 32>(x, rows, k, offsets));
    return nullptr;
}

// Whether two parts read x the same way (one rounding serves both).
inline bool same_reading(const Part& a, const Part& b) {
    return a.bits == b.bits && a.group == b.group && a.act == b.act && !a.sub == !b.sub && !a.mins == !b.mins &&
           !a.offset == !b.offset;
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
    parallel_features(start[num_parts], rows, k, threads, [&](int64_t f, int64_t r0, int64_t r1) {
        int64_t p = 0;
        while (f >= start[p + 1]) ++p;
        readers[p]->feature(parts[p], f - start[p], r0, r1, y + start[p], ldy);
    });
    return 0;
}

}  // namespace

// run_projection built for AVX-512 VNNI (qlinear_vnni.cpp); called only where the CPU has it.
int qlinear_parts_vnni(const float* x, int64_t rows, int64_t k, const Part* parts, int64_t num_parts, float* y,
                       int64_t ldy, int threads);
