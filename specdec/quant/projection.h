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
#include "tiles_rows16_g64.h"
#include "tiles_rows16_many.h"

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
};

// int8 per G values, one float scale (and offset) per group of G (tiles_group_x.h): the file's 4-bit Q4_0 /
// Q4_1 and 8-bit Q5_0 / Q8_0 codes per 32.
template <int BITS, int G>
class A8Reader final : public Reader {
   public:
    A8Reader(const float* x, int64_t rows, int64_t k, bool offsets)
        : k_(k), xq_(buffer<int8_t>(rows * k)), sx_(buffer<float>(rows * (k / G))),
          sums_(offsets ? buffer<float>(rows * (k / G)) : nullptr) {
        quantize_rows<G>(x, rows, k, G, xq_.get(), sx_.get(), sums_.get());
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
                tile_a8_pairs<BITS, G, MT, NP>(xq, sx, k_, xs, c, bytes, s, o, y + r * ldy + j, ldy);
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

// K-quant super-blocks (Q4_K: BITS 4, Q6_K: BITS 6) under int16 activations (int4-a16): x rounded per
// 256 values to int16 (quantize_rows16), then tile_a16. Under int8 they read row-interleaved tiles
// (Rows16Reader).
template <int BITS>
class SuperReader final : public Reader {
    static constexpr int G = BITS == 4 ? 32 : 16;

   public:
    // offsets: float offsets, on the unrounded x (int4-a16's rounding is 256 times finer than int8's)
    SuperReader(const float* x, int64_t rows, int64_t k, bool offsets)
        : k_(k), xq_(buffer<int16_t>(rows * k)), dx_(buffer<float>(rows * (k / 256))),
          sums_(offsets ? group_sums<G>(x, rows, k) : nullptr) {
        quantize_rows16(x, rows, k, xq_.get(), dx_.get());
    }

    void feature(const Part& p, int64_t j, int64_t r0, int64_t r1, float* y, int64_t ldy) const override {
        const int64_t supers = k_ / 256, groups = k_ / G;
        const void* c = (const uint8_t*)p.codes + j * row_bytes<BITS>(k_);
        const int8_t* sub = p.sub + j * groups;
        const float* o = p.offset ? p.offset + j * groups : nullptr;
        row_tiles(r0, r1, [&](auto mt, int64_t r) {
            tile_a16<BITS, decltype(mt)::value>(xq_.get() + r * k_, dx_.get() + r * supers, k_,
                                                sums_ ? sums_.get() + r * groups : nullptr, c, sub,
                                                p.dsup + j * supers, o, y + r * ldy + j, ldy);
        });
    }

   private:
    int64_t k_;
    std::unique_ptr<int16_t[]> xq_;
    std::unique_ptr<float[]> dx_, sums_;
};

// A reader of row-interleaved tiles, whose unit is a column of 16 features: a feature is a run of one.
struct ColumnReader : Reader {
    void feature(const Part& part, int64_t j, int64_t r0, int64_t r1, float* y, int64_t ldy) const override {
        features(part, j, j + 1, r0, r1, y, ldy);
    }
};

// fn(t, lo, hi) for each tile column t of 16 features that [j0, j1) touches, lanes [lo, hi) of it in
// [j0, j1): a column's lanes are computed alike whoever asks for them, and only those asked are written.
template <class Fn>
inline void tile_columns(int64_t j0, int64_t j1, Fn fn) {
    for (int64_t t = j0 / 16; t * 16 < j1; ++t)
        fn(t, (int)(std::max(j0, t * 16) - t * 16), (int)(std::min(j1, t * 16 + 16) - t * 16));
}

// Q4_K (BITS 4) or Q6_K (BITS 6) under int8 on row-interleaved tiles (tiles_rows16.h): x rounded per 256
// values in element order, with the integer sums the tiles' offsets need (Rows16Sum: the minimums' term,
// Q6_K's offset of 32).
template <int BITS>
class Rows16Reader final : public ColumnReader {
    static constexpr int G = BITS == 4 ? 32 : 16;
    static constexpr int64_t kBytes = BITS == 4 ? kRows16Bytes : kRows16Bytes6;
    using Sum = Rows16Sum<BITS>;

   public:
    Rows16Reader(const float* x, int64_t rows, int64_t k)
        : k_(k), xq_(buffer<int8_t>(rows * k)), dx_(buffer<float>(rows * (k / 256))),
          sums_(buffer<Sum>(rows * rows16_sums<BITS>(k))) {
        if constexpr (std::is_same_v<Sum, int32_t>) {
            quantize_rows<G>(x, rows, k, 256, xq_.get(), dx_.get(), nullptr);
            q6k_offsets(xq_.get(), rows * k, sums_.get());
        } else {
            quantize_rows<G>(x, rows, k, 256, xq_.get(), dx_.get(), nullptr, sums_.get());
        }
    }

    void features(const Part& p, int64_t j0, int64_t j1, int64_t r0, int64_t r1, float* y,
                  int64_t ldy) const override {
        const int64_t supers = k_ / 256, sums = rows16_sums<BITS>(k_);
        tile_columns(j0, j1, [&](int64_t t, int lo, int hi) {
            const uint8_t* tile = p.tiles + t * supers * kBytes;
            prefetch_lines(tile, kBytes);  // the tiles ask for the super-block after their own
#ifdef __AVX512VNNI__
            if constexpr (BITS == 4)
                if (r1 - r0 > kRows16Tile) {  // past one register tile: every row in one pass (tiles_rows16_many.h)
                    rows16_many(xq_.get() + r0 * k_, dx_.get() + r0 * supers, sums_.get() + r0 * sums, k_, tile,
                                y + r0 * ldy + t * 16, ldy, lo, hi, r1 - r0);
                    return;
                }
#endif
            balanced_tiles<kRows16Tile>(r0, r1, [&](auto mt, int64_t r) {
                rows16<BITS, decltype(mt)::value>(xq_.get() + r * k_, dx_.get() + r * supers, sums_.get() + r * sums,
                                                  k_, tile, y + r * ldy + t * 16, ldy, lo, hi);
            });
        });
    }

   private:
    int64_t k_;
    std::unique_ptr<int8_t[]> xq_;
    std::unique_ptr<float[]> dx_;
    std::unique_ptr<Sum[]> sums_;  // Rows16Sum: group sums, or Q6_K's offsets under VNNI
};

// A draft's 4- or 3-bit codes per 64 values (q4_64, q3_64) under int8 on row-interleaved tiles
// (tiles_rows16_g64.h): x rounded per 64 values, with each group's sum of the rounded values (the offsets' term).
template <int BITS>
class Rows64Reader final : public ColumnReader {
   public:
    Rows64Reader(const float* x, int64_t rows, int64_t k)
        : k_(k), xq_(buffer<int8_t>(rows * k)), dx_(buffer<float>(rows * (k / 64))), xs_(buffer<float>(rows * (k / 64))) {
        quantize_rows<64>(x, rows, k, 64, xq_.get(), dx_.get(), xs_.get());
    }

    void features(const Part& p, int64_t j0, int64_t j1, int64_t r0, int64_t r1, float* y,
                  int64_t ldy) const override {
        const int64_t groups = k_ / 64, bytes = kRows64Bytes[BITS];
        tile_columns(j0, j1, [&](int64_t t, int lo, int hi) {
            const uint8_t* tile = p.tiles + t * groups * bytes;
            prefetch_lines(tile, 6 * bytes);  // the tiles ask for the group six past their own
            balanced_tiles(r0, r1, [&](auto mt, int64_t r) {
                rows16_g64<BITS, decltype(mt)::value>(xq_.get() + r * k_, dx_.get() + r * groups,
                                                      xs_.get() + r * groups, k_, tile, y + r * ldy + t * 16, ldy,
                                                      lo, hi);
            });
        });
    }

   private:
    int64_t k_;
    std::unique_ptr<int8_t[]> xq_;
    std::unique_ptr<float[]> dx_, xs_;
};

// The reader a part needs, or null for a layout the integer paths do not take.
inline std::unique_ptr<Reader> make_reader(const Part& p, const float* x, int64_t rows, int64_t k) {
    if (p.dense || (p.act != 8 && p.act != 16) || k % 32) return nullptr;
    if (p.tiles) {
        if (p.act == 8 && p.group == 64 && k % 64 == 0) {
            if (p.bits == 4) return std::unique_ptr<Reader>(new Rows64Reader<4>(x, rows, k));
            return p.bits == 3 ? std::unique_ptr<Reader>(new Rows64Reader<3>(x, rows, k)) : nullptr;
        }
        if (p.act != 8 || k % 256) return nullptr;
        if (p.bits == 4) return std::unique_ptr<Reader>(new Rows16Reader<4>(x, rows, k));
        return p.bits == 6 ? std::unique_ptr<Reader>(new Rows16Reader<6>(x, rows, k)) : nullptr;
    }
    const bool offsets = p.offset != nullptr;
    if (p.sub) {  // K-quant super-blocks: int8 reads the tiles (above), int16 the file's layout
        if (p.act != 16 || k % 256 || !p.dsup) return nullptr;
        if (p.bits == 4 && p.group == 32) return std::unique_ptr<Reader>(new SuperReader<4>(x, rows, k, offsets));
        if (p.bits == 6 && p.group == 16) return std::unique_ptr<Reader>(new SuperReader<6>(x, rows, k, offsets));
        return nullptr;
    }
    if (p.act != 8 || k % p.group) return nullptr;
    if (p.group == 32 && p.bits == 4) return std::unique_ptr<Reader>(new A8Reader<4, 32>(x, rows, k, offsets));
    if (p.group == 32 && p.bits == 8) return std::unique_ptr<Reader>(new A8Reader<8, 32>(x, rows, k, offsets));
    return nullptr;
}

// Whether two parts read x the same way (one rounding serves both).
inline bool same_reading(const Part& a, const Part& b) {
    return a.bits == b.bits && a.group == b.group && a.act == b.act && !a.sub == !b.sub && !a.mins == !b.mins &&
           !a.offset == !b.offset && !a.tiles == !b.tiles;
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

// Rows from which a call is a prompt's: a thread takes a tile of features whose codes fill about
// kPromptTileBytes of L2 and runs every row through it, kPromptSpan rows at a time (their int8
// activations stay in L2 too; a tiled K-quant decodes each group once for the span's rows), so the
// weights come from memory once per call, not once per row block (ffn_down's 8-row blocks read its codes
// 32 times for 256 rows).
constexpr int64_t kPromptRows = 32;
constexpr int64_t kPromptTileBytes = 96 * 1024;
constexpr int64_t kPromptSpan = 32;

// A prompt's rows through every feature: each thread takes a tile of features (whole row-interleaved
// tiles of 16) and runs every row through them, kPromptSpan rows at a time.
inline void run_prompt(const std::vector<const Reader*>& readers, const Part* parts, const std::vector<int64_t>& start,
                       int64_t rows, int64_t k, float* y, int64_t ldy, int threads) {
    const int64_t num_parts = (int64_t)readers.size(), n = start[num_parts];
    int64_t code_bytes = 1;  // a feature's packed bytes, the most any part has
    for (int64_t p = 0; p < num_parts; ++p) code_bytes = std::max(code_bytes, k * parts[p].bits / 8);
    const int64_t f = std::max<int64_t>(16, kPromptTileBytes / code_bytes / 16 * 16), tiles = (n + f - 1) / f;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t j0 = t * f, j1 = std::min(j0 + f, n);
        for (int64_t r = 0; r < rows; r += kPromptSpan) {
            const int64_t r1 = std::min(r + kPromptSpan, rows);
            part_runs(start, j0, j1, [&](int64_t p, int64_t a, int64_t b) {
                readers[p]->features(parts[p], a, b, r, r1, y + start[p], ldy);
            });
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
    // rows in blocks whose x (int16 or int8) stays in L2; features in chunks on demand, whole
    // row-interleaved tiles of 16
    const bool wide = std::any_of(parts, parts + num_parts, [](const Part& p) { return p.act == 16; });
    const int64_t n = start[num_parts], block = row_block(k, wide ? 2 : 1);
    const int64_t chunk = (chunk_size(n, threads, 4) + 15) / 16 * 16, chunks = (n + chunk - 1) / chunk;
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
