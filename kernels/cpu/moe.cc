#include "kernels/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace baton::kernels::cpu {
namespace {

// p = softmax(z) over n entries: exp(z − max) in float, the sum in double in
// index order.
void Softmax(float* p, const float* z, int64_t n) {
  float max = z[0];
  for (int64_t e = 1; e < n; ++e) max = z[e] > max ? z[e] : max;
  double sum = 0.0;
  for (int64_t e = 0; e < n; ++e) {
    p[e] = std::exp(z[e] - max);
    sum += p[e];
  }
  const double inv = 1.0 / sum;
  for (int64_t e = 0; e < n; ++e) p[e] = static_cast<float>(p[e] * inv);
}

// top[0, k) = the indices of the k largest p, in descending order of p and
// ascending index among equal values: an insertion sort in which a later
// (higher) index moves only past strictly smaller values.
void TopK(int32_t* top, const float* p, int64_t n, int64_t k) {
  int64_t filled = 0;
  for (int64_t e = 0; e < n; ++e) {
    if (filled == k && !(p[e] > p[top[k - 1]])) continue;
    int64_t pos = filled < k ? filled++ : k - 1;
    while (pos > 0 && p[e] > p[top[pos - 1]]) {
      top[pos] = top[pos - 1];
      --pos;
    }
    top[pos] = static_cast<int32_t>(e);
  }
}

}  // namespace

void RouterTopK(float* probs, int32_t* expert, float* gate, const float* logits, int64_t tokens,
                int64_t experts, int64_t k, bool renormalize) {
  for (int64_t t = 0; t < tokens; ++t) {
    float* p = probs + t * experts;
    int32_t* top = expert + t * k;
    float* g = gate + t * k;
    Softmax(p, logits + t * experts, experts);
    TopK(top, p, experts, k);
    if (!renormalize) {
      for (int64_t j = 0; j < k; ++j) g[j] = p[top[j]];
      continue;
    }
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) sum += p[top[j]];
    for (int64_t j = 0; j < k; ++j) g[j] = static_cast<float>(p[top[j]] / sum);
  }
}

void RouterTopKBackward(float* dlogits, const float* dgate, const int32_t* expert,
                        const float* gate, const float* probs, int64_t tokens, int64_t experts,
                        int64_t k, bool renormalize) {
  for (int64_t t = 0; t < tokens; ++t) {
    float* dz = dlogits + t * experts;
    const float* dg = dgate + t * k;
    const int32_t* top = expert + t * k;
    if (renormalize) {
      const float* g = gate + t * k;
      double dot = 0.0;  // Σ_i g_i dg_i
      for (int64_t j = 0; j < k; ++j) dot += static_cast<double>(g[j]) * dg[j];
      std::fill(dz, dz + experts, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        dz[top[j]] = static_cast<float>(g[j] * (dg[j] - dot));
      }
      continue;
    }
    // Raw gates: dz_e = p_e · (a_e − Σ_j p_{e_j} dg_j), a_e = dg_j for a
    // chosen e = e_j, else 0.
    const float* p = probs + t * experts;
    double dot = 0.0;  // Σ_j p_{e_j} dg_j
    for (int64_t j = 0; j < k; ++j) dot += static_cast<double>(p[top[j]]) * dg[j];
    for (int64_t e = 0; e < experts; ++e) dz[e] = static_cast<float>(p[e] * (0.0 - dot));
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = top[j];
      dz[e] = static_cast<float>(p[e] * (static_cast<double>(dg[j]) - dot));
    }
  }
}

int64_t ExpertCapacity(int64_t tokens, int64_t experts, int64_t k, double capacity_factor) {
  if (capacity_factor == 0.0) return tokens * k;
  const double rows = capacity_factor * static_cast<double>(tokens * k) / experts;
  const double nearest = std::nearbyint(rows);
  if (std::fabs(rows - nearest) <= 1e-9 * std::max(1.0, nearest)) {
    return static_cast<int64_t>(nearest);
  }
  return static_cast<int64_t>(std::ceil(rows));
}

void PlanDispatch(int32_t* slot, int64_t* counts, const int32_t* expert, int64_t tokens,
                  int64_t experts, int64_t k, int64_t capacity) {
  std::fill(counts, counts + experts, int64_t{0});
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t i = t * k + j;
      int64_t& count = counts[expert[i]];
      if (count < capacity) {
        slot[i] = static_cast<int32_t>(count++);
      } else {
        slot[i] = kDroppedSlot;
      }
    }
  }
}

void Permute(float* expert_in, const float* x, const int32_t* expert, const int32_t* slot,
             int64_t tokens, int64_t experts, int64_t k, int64_t hidden, int64_t capacity) {
  std::fill(expert_in, expert_in + experts * capacity * hidden, 0.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t i = t * k + j;
      if (slot[i] == kDroppedSlot) continue;
      std::memcpy(expert_in + (expert[i] * capacity + slot[i]) * hidden, x + t * hidden,
                  hidden * sizeof(float));
    }
  }
}

void PermuteBackward(float* dx, const float* dexpert_in, const int32_t* expert, const int32_t* slot,
                     int64_t tokens, int64_t k, int64_t hidden, int64_t capacity) {
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = dx + t * hidden;
    std::fill(row, row + hidden, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t i = t * k + j;
      if (slot[i] == kDroppedSlot) continue;
      const float* src = dexpert_in + (expert[i] * capacity + slot[i]) * hidden;
      for (int64_t h = 0; h < hidden; ++h) row[h] += src[h];
    }
  }
}

void Combine(float* y, const float* expert_out, const float* gate, const int32_t* expert,
             const int32_t* slot, int64_t tokens, int64_t k, int64_t hidden, int64_t capacity) {
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = y + t * hidden;
    std::fill(row, row + hidden, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t i = t * k + j;
      if (slot[i] == kDroppedSlot) continue;
      const float* src = expert_out + (expert[i] * capacity + slot[i]) * hidden;
      const float g = gate[i];
      for (int64_t h = 0; h < hidden; ++h) row[h] += g * src[h];
    }
  }
}

void CombineBackward(float* dexpert_out, float* dgate, const float* dy, const float* expert_out,
                     const float* gate, const int32_t* expert, const int32_t* slot, int64_t tokens,
                     int64_t experts, int64_t k, int64_t hidden, int64_t capacity) {
  std::fill(dexpert_out, dexpert_out + experts * capacity * hidden, 0.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* dyt = dy + t * hidden;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t i = t * k + j;
      if (slot[i] == kDroppedSlot) {
        dgate[i] = 0.0f;
        continue;
      }
      const int64_t offset = (expert[i] * capacity + slot[i]) * hidden;
      const float* out = expert_out + offset;
      float* dout = dexpert_out + offset;
      const float g = gate[i];
      double dot = 0.0;
      for (int64_t h = 0; h < hidden; ++h) {
        dout[h] = g * dyt[h];
        dot += static_cast<double>(dyt[h]) * out[h];
      }
      dgate[i] = static_cast<float>(dot);
    }
  }
}

double LoadBalancingLoss(float* dlogits_aux, const float* probs, const int32_t* expert,
                         int64_t tokens, int64_t experts, int64_t k, float coef) {
  // c[e] = coef · E · f_e / N, the loss's derivative w.r.t. p[t,e].
  std::vector<double> c(experts, 0.0);
  for (int64_t i = 0; i < tokens * k; ++i) c[expert[i]] += 1.0;
  const double n = static_cast<double>(tokens);
  const double scale = static_cast<double>(coef) * experts / (n * k) / n;
  for (int64_t e = 0; e < experts; ++e) c[e] *= scale;
  // loss = Σ_e c_e · Σ_t p[t,e]; the column sums go in token order.
  double loss = 0.0;
  for (int64_t e = 0; e < experts; ++e) {
    double column = 0.0;
    for (int64_t t = 0; t < tokens; ++t) column += probs[t * experts + e];
    loss += c[e] * column;
  }
  for (int64_t t = 0; t < tokens; ++t) {
    const float* p = probs + t * experts;
    float* dz = dlogits_aux + t * experts;
    double dot = 0.0;
    for (int64_t e = 0; e < experts; ++e) dot += p[e] * c[e];
    for (int64_t e = 0; e < experts; ++e) dz[e] = static_cast<float>(p[e] * (c[e] - dot));
  }
  return loss;
}

void ExpertTokenCounts(int64_t* routed, const int32_t* expert, int64_t tokens, int64_t experts,
                       int64_t k) {
  std::fill(routed, routed + experts, int64_t{0});
  for (int64_t i = 0; i < tokens * k; ++i) ++routed[expert[i]];
}

}  // namespace baton::kernels::cpu
