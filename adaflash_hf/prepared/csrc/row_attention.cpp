// Causal attention computed row by row in one fixed order: a query row's result is a function of that row, its
// position and the keys it sees, and of nothing else (not the other rows of the call, their number, the keys after
// it, the thread that computes it, nor the CPU's matrix kernels), because every operation on the row is written here
// in one order:
//
//   scores  s_j = (sum over d of q_d k_jd, in 16 lanes of d mod 16 added in a fixed tree) * scale, for the keys j the
//           row sees, in ascending order;
//   softmax m = max_j s_j; p_j = exp(s_j - m) (the polynomial below); l = the sum of p_j in 16 lanes of j mod 16,
//           added in a fixed tree;
//   output  o = (sum over even j of p_j v_j) + (sum over odd j of p_j v_j), each in ascending j; o / l in the query's
//           dtype.
//
// Keys and values are read in float32 (bf16 widened exactly). adaflash_hf/prepared/attention.py says where it runs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

inline float widen(float value) { return value; }
inline float widen(c10::BFloat16 value) {
  uint32_t bits = static_cast<uint32_t>(value.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// exp(x) for x <= 0 in a fixed sequence of float operations (Cody-Waite reduction by ln 2, a degree-6 polynomial,
// the exponent set by integer arithmetic); 0 below -87 (and for -inf)
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  const bool zero = !(x > -87.0f);
  x = zero ? 0.0f : x;  // (vectorised without branches with -fno-trapping-math)
  const int32_t n = -static_cast<int32_t>(-x * 1.44269504088896341f + 0.5f);  // round(x / ln 2), x <= 0
  const float k = static_cast<float>(n);
  float r = x - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return zero ? 0.0f : p * scale;
}

// A run of rows of one sequence and one key head: `queries` (pointers into the query, each row's `dim` contiguous)
// that see the first `seen[r]` of the keys at base + index(j) * stride (index: every key in turn where empty), their
// results written to `outs`.
template <typename T>
struct Run {
  std::vector<const T*> queries;
  std::vector<T*> outs;
  std::vector<int64_t> seen;
  const T* key_base;
  const T* value_base;
  int64_t key_stride, value_stride;
  std::vector<int64_t> index;
};

// 16 floats as one value (GCC/Clang vector extension: one AVX-512 register, two AVX2 ones, or scalar code)
typedef float Lanes __attribute__((vector_size(64), aligned(4), may_alias));

__attribute__((always_inline)) inline Lanes load(const float* from) { return *reinterpret_cast<const Lanes*>(from); }

typedef uint16_t Halves __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint32_t Words __attribute__((vector_size(64)));

// 16 bf16 values widened (exactly: their bits in the high half of a float's)
__attribute__((always_inline)) inline Lanes load(const c10::BFloat16* from) {
  const Words words = __builtin_convertvector(*reinterpret_cast<const Halves*>(from), Words) << 16;
  return reinterpret_cast<const Lanes&>(words);
}

typedef float Eight __attribute__((vector_size(32)));
typedef float Four __attribute__((vector_size(16)));

// The fixed tree over 16 lanes: lanes i + (i + 8), then i + (i + 4), then (0 + 2) + (1 + 3)
__attribute__((always_inline)) inline float lane_sum(Lanes lanes) {
  const Eight eight = __builtin_shufflevector(lanes, lanes, 0, 1, 2, 3, 4, 5, 6, 7) +
                      __builtin_shufflevector(lanes, lanes, 8, 9, 10, 11, 12, 13, 14, 15);
  const Four four = __builtin_shufflevector(eight, eight, 0, 1, 2, 3) + __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
  const Four two = four + __builtin_shufflevector(four, four, 2, 3, 0, 1);
  return two[0] + two[1];
}

// A row's score for one key: its 16 lanes (d mod 16) summed over d in order, then the fixed tree
template <int Chunks>
__attribute__((always_inline)) inline float score(const Lanes* query, const float* key, int64_t chunks) {
  Lanes lanes = query[0] * load(key);
  for (int64_t c = 1; c < (Chunks ? Chunks : chunks); ++c) lanes += query[c] * load(key + c * kLanes);
  return lane_sum(lanes);
}

// The rows of a run (the top of this file) over float32 keys and values [count, dim] in the order the rows see them.
// What a row computes does not depend on the others. Chunks: the head dim / 16 where it is known here, else 0.
template <int Chunks, typename T>
void attend_rows(const Run<T>& run, const float* keys, const float* values, int64_t dim, float scale, float* scores) {
  constexpr int kMost = Chunks ? Chunks : 32;
  const int64_t chunks = Chunks ? Chunks : dim / kLanes;
  const float infinity = std::numeric_limits<float>::infinity();
  for (size_t r = 0; r < run.queries.size(); ++r) {
    T* out = run.outs[r];
    const int64_t seen = run.seen[r], tail = (seen + kLanes - 1) / kLanes * kLanes;
    if (seen == 0) {
      for (int64_t d = 0; d < dim; ++d) out[d] = T(0.0f);
      continue;
    }
    Lanes query[kMost];
    for (int64_t c = 0; c < chunks; ++c) query[c] = load(run.queries[r] + c * kLanes);
    for (int64_t j = 0; j < seen; ++j) scores[j] = score<Chunks>(query, keys + j * dim, chunks) * scale;
    for (int64_t j = seen; j < tail; ++j) scores[j] = -infinity;
    // the maximum in 16 lanes (exact in any order), then the softmax's numerators and their sum in 16 lanes
    float top[kLanes];
    for (int64_t l = 0; l < kLanes; ++l) top[l] = -infinity;
    for (int64_t j = 0; j < tail; j += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) top[l] = scores[j + l] > top[l] ? scores[j + l] : top[l];
    float maximum = top[0];
    for (int64_t l = 1; l < kLanes; ++l) maximum = top[l] > maximum ? top[l] : maximum;
    for (int64_t j = 0; j < tail; ++j) scores[j] = exp_nonpositive(scores[j] - maximum);
    Lanes sums = {};
    for (int64_t j = 0; j < tail; j += kLanes) sums += load(scores + j);
    const float total = lane_sum(sums);
    // the value sums: even keys and odd keys apart, each in ascending order, then added
    Lanes even[kMost], odd[kMost];
    for (int64_t c = 0; c < (Chunks ? Chunks : chunks); ++c) even[c] = odd[c] = Lanes{};
    int64_t j = 0;
    for (; j + 2 <= seen; j += 2) {
      const float pe = scores[j], po = scores[j + 1];
      const float *ve = values + j * dim, *vo = ve + dim;
      for (int64_t c = 0; c < (Chunks ? Chunks : chunks); ++c) {
        even[c] += pe * load(ve + c * kLanes);
        odd[c] += po * load(vo + c * kLanes);
      }
    }
    if (j < seen) {
      const float pe = scores[j];
      const float* ve = values + j * dim;
      for (int64_t c = 0; c < (Chunks ? Chunks : chunks); ++c) even[c] += pe * load(ve + c * kLanes);
    }
    for (int64_t c = 0; c < (Chunks ? Chunks : chunks); ++c) {
      float part[kLanes];
      const Lanes sum = even[c] + odd[c];
      std::memcpy(part, &sum, sizeof(part));
      for (int64_t l = 0; l < kLanes; ++l) out[c * kLanes + l] = T(part[l] / total);
    }
  }
}

// A run's rows over float32 copies of its keys and values, made once for all of them (widening is exact)
template <typename T, int Chunks>
void attend_run(const Run<T>& run, int64_t dim, float scale, std::vector<float>& buffer) {
  const int64_t count = *std::max_element(run.seen.begin(), run.seen.end());
  const int64_t padded = (count + kLanes - 1) / kLanes * kLanes;
  const int64_t* index = run.index.empty() ? nullptr : run.index.data();
  buffer.resize(2 * count * dim + padded);
  float* keys = buffer.data();
  float* values = keys + count * dim;
  for (int64_t j = 0; j < count; ++j) {
    const T* key = run.key_base + (index ? index[j] : j) * run.key_stride;
    const T* value = run.value_base + (index ? index[j] : j) * run.value_stride;
    for (int64_t d = 0; d < dim; ++d) keys[j * dim + d] = widen(key[d]);
    for (int64_t d = 0; d < dim; ++d) values[j * dim + d] = widen(value[d]);
  }
  attend_rows<Chunks>(run, keys, values, dim, scale, values + count * dim);
}

// The runs on the intra-op threads, each taking the next of the longest first (what a run computes does not depend on
// the thread that runs it)
template <typename T>
void attend_runs(std::vector<Run<T>>& runs, int64_t dim, float scale) {
  std::vector<int64_t> order(runs.size()), cost(runs.size());
  for (size_t i = 0; i < runs.size(); ++i) {
    order[i] = static_cast<int64_t>(i);
    cost[i] = runs[i].queries.empty()
                  ? 0
                  : static_cast<int64_t>(runs[i].queries.size() + 4) *
                        *std::max_element(runs[i].seen.begin(), runs[i].seen.end());
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(runs.size()));
  at::parallel_for(0, std::max<int64_t>(workers, 1), 1, [&](int64_t, int64_t) {
    std::vector<float> buffer;
    for (int64_t taken = next++; taken < static_cast<int64_t>(order.size()); taken = next++) {
      const Run<T>& run = runs[order[taken]];
      if (run.queries.empty()) continue;
      if (dim == 64)
        attend_run<T, 4>(run, dim, scale, buffer);
      else if (dim == 128)
        attend_run<T, 8>(run, dim, scale, buffer);
      else
        attend_run<T, 0>(run, dim, scale, buffer);
    }
  });
}

constexpr int64_t kRunRows = 32;  // query positions per run: runs of a long prefill spread over the threads

void check_inputs(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values) {
  TORCH_CHECK(query.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu(),
              "row attention: expected CPU tensors");
  TORCH_CHECK(query.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(),
              "row attention: expected one dtype for query, keys and values, got ", query.scalar_type(), ", ",
              keys.scalar_type(), ", ", values.scalar_type());
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "row attention: expected float32 or bfloat16, got ", query.scalar_type());
  const int64_t dim = query.size(-1);
  TORCH_CHECK(dim % kLanes == 0 && dim <= 512, "row attention: expected a head dim that is a multiple of 16 up to 512, got ",
              dim);
  TORCH_CHECK(keys.stride(-1) == 1 && values.stride(-1) == 1, "row attention: keys and values must be contiguous in "
              "their last dim");
}

// Where a sequence's keys and values are: [L, Hkv, D] at `keys`/`values` with strides (position, head), D contiguous
template <typename T>
struct Cache {
  const T* keys;
  const T* values;
  int64_t length, key_position, key_head, value_position, value_head;
};

template <typename T>
Cache<T> cache_of(const at::Tensor& keys, const at::Tensor& values) {  // keys/values [L, Hkv, D]
  return {keys.data_ptr<T>(), values.data_ptr<T>(), keys.size(0), keys.stride(0), keys.stride(1), values.stride(0),
          values.stride(1)};
}

// The runs of one sequence's rows: query/out [n, Hq, D] contiguous at positions start .. start + n - 1 over `cache`
// (key heads Hkv); mask: [n, mask_width] bool or null. Row r sees keys j <= start + r (where mask[r, j]); a row that
// sees none gives zeros.
template <typename T>
void sequence_runs(const T* q, T* o, int64_t count, int64_t heads, int64_t key_heads, int64_t dim, int64_t start,
                   const Cache<T>& cache, const bool* mask, int64_t mask_width, std::vector<Run<T>>& runs) {
  const int64_t group = heads / key_heads;
  for (int64_t head = 0; head < key_heads; ++head) {
    for (int64_t first = 0; first < count; first += mask ? 1 : kRunRows) {
      const int64_t last = mask ? first + 1 : std::min(count, first + kRunRows);
      Run<T> run;
      run.key_base = cache.keys + head * cache.key_head;
      run.value_base = cache.values + head * cache.value_head;
      run.key_stride = cache.key_position;
      run.value_stride = cache.value_position;
      if (mask) {  // the row's own keys, in order: the keys it sees, as if the others were not there
        const int64_t visible = std::min(cache.length, start + first + 1);
        for (int64_t j = 0; j < visible; ++j)
          if (mask[first * mask_width + j]) run.index.push_back(j);
      }
      for (int64_t row = first; row < last; ++row)
        for (int64_t member = 0; member < group; ++member) {
          const int64_t h = head * group + member;
          run.queries.push_back(q + (row * heads + h) * dim);
          run.outs.push_back(o + (row * heads + h) * dim);
          run.seen.push_back(mask ? static_cast<int64_t>(run.index.size()) : std::min(cache.length, start + row + 1));
        }
      runs.push_back(std::move(run));
    }
  }
}

}  // namespace

// Causal attention of one sequence: query [n, Hq, D] (positions start ..), keys/values [L, Hkv, D], allowed [n, L]
// bool or an empty tensor -> [n, Hq, D]. See the top of this file.
at::Tensor row_attention(const at::Tensor& query_in, const at::Tensor& keys, const at::Tensor& values, int64_t start,
                         double scale, const at::Tensor& allowed_in) {
  check_inputs(query_in, keys, values);
  auto query = query_in.contiguous();
  auto allowed = allowed_in.defined() && allowed_in.numel() ? allowed_in.to(at::kBool).contiguous()
                                                               : at::empty({0}, query.options().dtype(at::kBool));
  TORCH_CHECK(keys.size(0) >= start + query.size(0) && query.size(1) % keys.size(1) == 0,
              "row attention: expected at least start + n = ", start + query.size(0), " keys and a query head count ",
              "that is a multiple of the key heads, got ", keys.size(0), " keys, ", query.size(1), " and ",
              keys.size(1), " heads");
  TORCH_CHECK(!allowed.numel() || (allowed.size(0) == query.size(0) && allowed.size(1) >= start + query.size(0)),
              "row attention: expected a mask [", query.size(0), ", >= ", start + query.size(0), "], got ",
              allowed.sizes());
  auto out = at::empty_like(query);
  const int64_t count = query.size(0), heads = query.size(1), dim = query.size(2);
  const bool* mask = allowed.numel() ? allowed.data_ptr<bool>() : nullptr;
  AT_DISPATCH_SWITCH(query.scalar_type(), "row_attention",
                     AT_DISPATCH_CASE(at::kFloat,
                                      [&] {
                                        std::vector<Run<float>> runs;
                                        sequence_runs(query.data_ptr<float>(), out.data_ptr<float>(), count, heads,
                                                      keys.size(1), dim, start, cache_of<float>(keys, values), mask,
                                                      allowed.numel() ? allowed.size(1) : 0, runs);
                                        attend_runs(runs, dim, static_cast<float>(scale));
                                      })
                         AT_DISPATCH_CASE(at::kBFloat16, [&] {
                           std::vector<Run<c10::BFloat16>> runs;
                           sequence_runs(query.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), count, heads,
                                         keys.size(1), dim, start, cache_of<c10::BFloat16>(keys, values), mask,
                                         allowed.numel() ? allowed.size(1) : 0, runs);
                           attend_runs(runs, dim, static_cast<float>(scale));
                         }));
  return out;
}

// The serving engine's packed row: query [T, Hq, D]; requests (slot, start, offset, length) in turn, request i's
// rows query[offset : offset + length] at positions start .. over slot `slot` of the pools [slots, capacity, Hkv, D]
// (this forward's keys already written) -> [T, Hq, D].
at::Tensor packed_row_attention(const at::Tensor& query_in, const at::Tensor& key_pool, const at::Tensor& value_pool,
                                c10::IntArrayRef requests, double scale) {
  check_inputs(query_in, key_pool, value_pool);
  auto query = query_in.contiguous();
  auto out = at::empty_like(query);
  const int64_t heads = query.size(1), dim = query.size(2), key_heads = key_pool.size(2);
  TORCH_CHECK(key_pool.dim() == 4 && value_pool.sizes() == key_pool.sizes() && heads % key_heads == 0,
              "packed row attention: expected pools [slots, capacity, Hkv, D] of one shape, got ", key_pool.sizes(),
              " and ", value_pool.sizes());
  for (size_t i = 0; i < requests.size(); i += 4)
    TORCH_CHECK(requests[i] >= 0 && requests[i] < key_pool.size(0) &&
                    requests[i + 1] + requests[i + 3] <= key_pool.size(1) &&
                    requests[i + 2] + requests[i + 3] <= query.size(0),
                "packed row attention: request ", i / 4, " (slot, start, offset, length) = (", requests[i], ", ",
                requests[i + 1], ", ", requests[i + 2], ", ", requests[i + 3], ") does not fit pools ",
                key_pool.sizes(), " and ", query.size(0), " rows");
  auto runs_of = [&](auto* q, auto* o, auto* keys, auto* values, auto& runs) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(keys)>>;
    for (size_t i = 0; i < requests.size(); i += 4) {
      const int64_t slot = requests[i], start = requests[i + 1], offset = requests[i + 2], length = requests[i + 3];
      const Cache<T> cache{keys + slot * key_pool.stride(0), values + slot * value_pool.stride(0), key_pool.size(1),
                           key_pool.stride(1), key_pool.stride(2), value_pool.stride(1), value_pool.stride(2)};
      sequence_runs<T>(q + offset * heads * dim, o + offset * heads * dim, length, heads, key_heads, dim, start,
                       cache, nullptr, 0, runs);
    }
  };
  AT_DISPATCH_SWITCH(query.scalar_type(), "packed_row_attention",
                     AT_DISPATCH_CASE(at::kFloat,
                                      [&] {
                                        std::vector<Run<float>> runs;
                                        runs_of(query.data_ptr<float>(), out.data_ptr<float>(),
                                                key_pool.data_ptr<float>(), value_pool.data_ptr<float>(), runs);
                                        attend_runs(runs, dim, static_cast<float>(scale));
                                      })
                         AT_DISPATCH_CASE(at::kBFloat16, [&] {
                           std::vector<Run<c10::BFloat16>> runs;
                           runs_of(query.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(),
                                   key_pool.data_ptr<c10::BFloat16>(), value_pool.data_ptr<c10::BFloat16>(), runs);
                           attend_runs(runs, dim, static_cast<float>(scale));
                         }));
  return out;
}

TORCH_LIBRARY_FRAGMENT(adaflash_native, m) {
  m.def("row_attention(Tensor query, Tensor keys, Tensor values, int start, float scale, Tensor allowed) -> Tensor");
  m.impl("row_attention", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(row_attention));
  m.def(
      "packed_row_attention(Tensor query, Tensor key_pool, Tensor value_pool, int[] requests, float scale) -> Tensor");
  m.impl("packed_row_attention", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(packed_row_attention));
}
