// The verifier's coupled rows (sample/verifier.py): each target row's logits over its temperature,
// filtered (top-k, top-p, min-p) and picked by the Gumbel-max with its positional noise, as the draft
// chain picks (draft_pick.h). In torch this processing sorted a few thousand of a row's 152k values and
// masked the whole row, about 4 ms a row; only the values that can win are touched here.
#include <omp.h>

#include <vector>

#include "draft_pick.h"
#include "kernels.h"

extern "C" {

void coupled_picks(const float* logits, int64_t rows, int64_t vocab, const CoupledRow* params, int64_t* out,
                   int threads) {
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> x;
        Filters f;
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; ++r) {  // a row's pick is one thread's, whatever the batch
            const CoupledRow& p = params[r];
            const float* row = logits + r * vocab;
            x.resize(vocab);
            for (int64_t c = 0; c < vocab; ++c) x[c] = row[c] / p.temperature;
            filter(x, p.top_k, p.top_p, p.min_p, vocab, f);
            out[r] = coupled(x, p.noise_key, p.position, [](int64_t c) { return c; });
        }
    }
}

}  // extern "C"
