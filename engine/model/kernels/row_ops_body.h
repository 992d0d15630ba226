// The body of row_ops.cpp over Vec16 (vec16.h), included once per ISA. No include guard on purpose.
// Rows have any length n; a scalar tail handles what is not a whole block.

namespace SIE_ISA {

// max of 4 x 16 lanes of one 64-wide block
SIE_TARGET inline Vec16 block_max(const float* x) {
  return max(max(Vec16::load(x), Vec16::load(x + 16)), max(Vec16::load(x + 32), Vec16::load(x + 48)));
}

SIE_TARGET inline float row_max(const float* x, int64_t n) {
  Vec16 m = Vec16::set1(-INFINITY);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) m = max(m, block_max(x + i));
  float best = fold_max(m);
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
}

// log(sum(exp(x))) as max + log(sum(exp(x - max))); -inf for a row of -inf
SIE_TARGET inline float row_logsumexp(const float* x, int64_t n) {
  const float m = row_max(x, n);
  if (m == -INFINITY || std::isnan(m)) return m;
  const Vec16 mv = Vec16::set1(m);
  Vec16 s0 = Vec16::zero(), s1 = Vec16::zero();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = s0 + exp(Vec16::load(x + i) - mv);
    s1 = s1 + exp(Vec16::load(x + i + 16) - mv);
  }
  float s = fold_add(s0 + s1);
  for (; i < n; ++i) s += std::exp(x[i] - m);
  return m + std::log(s);
}

// index of the row's first maximum (torch's argmax): the first 64-block holding it, then a scalar look inside.
// A row with NaN: the first NaN only when the scan finds no maximum (torch always returns the first NaN).
SIE_TARGET inline int64_t row_argmax(const float* x, int64_t n) {
  const float m = row_max(x, n);
  if (m == -INFINITY) return 0;  // a row of -inf: its first entry
  const float below = std::nextafter(m, -INFINITY);  // v > below exactly when v >= m
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    if (block_max(x + i).any_above(below)) break;
  for (; i < n; ++i)
    if (x[i] == m) return i;
  for (i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return 0;  // unreachable
}

// The k largest of a row, by (value descending, index ascending); NaN orders below -inf (never chosen over a
// number). First a lower bound: the k-th largest of the 64-blocks' maxima (k distinct entries at least that
// large), when there are k blocks. Then one scan keeps the entries at or above it, skipping whole blocks below
// it with one vector compare, and prunes its candidates back to k (nth_element) whenever they reach `cap`,
// raising the bound to the k-th best so far. On a 50k vocabulary that is one vector pass and a few hundred
// candidates.
SIE_TARGET inline void row_topk(const float* x, int64_t n, int64_t k, float* values, int64_t* indices,
                                std::vector<std::pair<float, int64_t>>& buf, std::vector<float>& block_maxima) {
  const auto key = [](float v) { return std::isnan(v) ? -INFINITY : v; };
  const auto better = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  const int64_t blocks = n / 64;
  float bound = -INFINITY;  // every one of the k largest is >= bound
  if (blocks >= k) {
    block_maxima.resize(static_cast<size_t>(blocks));
    for (int64_t b = 0; b < blocks; ++b) block_maxima[static_cast<size_t>(b)] = key(fold_max(block_max(x + b * 64)));
    std::nth_element(block_maxima.begin(), block_maxima.begin() + (k - 1), block_maxima.end(), std::greater<float>());
    bound = block_maxima[static_cast<size_t>(k - 1)];
  }
  const size_t cap = static_cast<size_t>(2 * k + 64);
  buf.clear();
  bool pruned = false;  // after a prune, only entries strictly above `bound` (the k-th best so far) can enter
  const auto take = [&](int64_t i) {
    const float v = key(x[i]);
    if (pruned ? !(v > bound) : v < bound) return;
    buf.emplace_back(v, i);
    if (buf.size() >= cap) {
      std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), better);
      buf.resize(static_cast<size_t>(k));
      bound = buf[static_cast<size_t>(k - 1)].first;  // the worst of the k kept
      pruned = true;
    }
  };
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    if (pruned || bound > -INFINITY) {  // skip a block with nothing that could enter
      const float below = pruned ? bound : std::nextafter(bound, -INFINITY);
      if (!block_max(x + i).any_above(below)) continue;
    }
    for (int64_t j = i; j < i + 64; ++j) take(j);
  }
  for (; i < n; ++i) take(i);
  std::partial_sort(buf.begin(), buf.begin() + k, buf.end(), better);
  for (int64_t j = 0; j < k; ++j) {
    indices[j] = buf[static_cast<size_t>(j)].second;
    values[j] = x[indices[j]];
  }
}

// Penalties on one row in place, the arithmetic of engine/sampling/sampler.py: over prompt and output tokens the
// repetition penalty (HF/vLLM: shrink toward zero), then over output tokens frequency and presence (OpenAI).
// Only the entries a row has seen change (a few hundred of 50k-250k), so the loop branches to them; the scan
// itself is a load or two per entry.
SIE_TARGET inline void penalize_row(float* x, const float* counts, const bool* prompt, int64_t n, float rep,
                                    float pres, float freq) {
  for (int64_t t = 0; t < n; ++t) {
    const float c = counts[t];
    const bool counted = c > 0.0f;
    if (!counted && !(prompt != nullptr && prompt[t])) continue;
    float v = x[t];
    if (prompt != nullptr) v = v > 0.0f ? v / rep : v * rep;
    if (counted) v = (v - freq * c) - pres;
    x[t] = v;
  }
}

}  // namespace SIE_ISA
