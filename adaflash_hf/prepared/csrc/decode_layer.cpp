// A decoder layer of a prepared Llama target over the new tokens of one sequence, as one call: the ATen ops the lean
// layer (adaflash_hf/prepared/lean.py) runs for those tokens, in the same order, on the same shapes and dtypes, each
// linear in the tiles the Python code calls it in (adaflash_hf/prepared/tiles.py), and the row attention
// (row_attention.cpp) the invariant attention (adaflash_hf/prepared/attention.py) calls where this library is loaded,
// so the result is bitwise the Python layer's; only the interpreter's time between the ops goes.
// adaflash_hf/prepared/native.py says what the arguments are and when a forward runs here.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kFourBit = 0;  // (codes, scales): aten::_weight_int4pack_mm_for_cpu
constexpr int64_t kPacked = 1;   // (oneDNN's prepacked weight, unused): mkldnn::_linear_pointwise
constexpr int64_t kPlain = 2;    // (the weight, unused): aten::linear
constexpr int64_t kFourBitGroup = 32;

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<c10::Scalar>>,
                                         std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<c10::Scalar>>(), c10::string_view(""));
}

// Tiles.calls: the rows of the next call with `left` rows (a whole number of tiles) left: the largest admitted large
// size that fits (`large`: bit m set where m tiles in one call agree, Tiles.large_mask), else a tile
int64_t call_rows(int64_t rows, int64_t large, int64_t left) {
  for (int64_t multiple = 62; multiple > 1; --multiple)
    if ((large >> multiple) & 1 && rows * multiple <= left) return rows * multiple;
  return rows;
}

struct Linear {
  int64_t kind, rows, small, large;
  at::Tensor a, b;
  std::optional<at::Tensor> bias;

  at::Tensor call(const at::Tensor& x) const {
    if (kind == kFourBit) {
      auto out = at::_weight_int4pack_mm_for_cpu(x, a, kFourBitGroup, b);
      return bias ? out + *bias : out;
    }
    if (kind == kPacked) return packed_linear(x, a, bias);
    return at::linear(x, a, bias);
  }

  // Tiles.run: x [count, K] in calls of exactly `rows` rows (padded with zeros, cropped), or as is where count is
  // the op's agreeing small shape, or in its large calls (call_rows)
  at::Tensor run(const at::Tensor& x) const {
    const int64_t count = x.size(0);
    if (count == rows || (count < rows && count == small)) return call(x.contiguous());
    const int64_t whole = (count + rows - 1) / rows * rows;
    // tiles.padded_rows: x itself where it is whole tiles already, else a copy padded with zero rows
    auto padded = x;
    if (whole != count || !x.is_contiguous()) {
      padded = at::empty({whole, x.size(1)}, x.options());
      padded.narrow(0, 0, count).copy_(x);
      padded.narrow(0, count, whole - count).zero_();
    }
    std::vector<at::Tensor> outputs;
    for (int64_t start = 0; start < whole;) {
      const int64_t size = call_rows(rows, large, whole - start);
      auto tile = padded.narrow(0, start, size);
      // tiles._tile: a fresh copy where the slice would not be 64-byte aligned
      if (reinterpret_cast<uintptr_t>(tile.data_ptr()) % 64) tile = tile.clone(at::MemoryFormat::Contiguous);
      outputs.push_back(call(tile));
      start += size;
    }
    auto out = outputs.size() == 1 ? outputs[0] : at::cat(outputs, 0);
    return whole == count ? out : out.narrow(0, 0, count);
  }

  // hidden [1, n, K] -> [1, n, N]
  at::Tensor operator()(const at::Tensor& hidden) const {
    auto out = run(hidden.reshape({-1, hidden.size(-1)}));
    return out.reshape({1, hidden.size(1), out.size(-1)});
  }
};

Linear linear_of(const std::vector<at::Tensor>& weights, const std::vector<int64_t>& numbers, int64_t index) {
  Linear linear{numbers[4 * index],     numbers[4 * index + 1], numbers[4 * index + 2],
                numbers[4 * index + 3], weights[2 + 3 * index], weights[3 + 3 * index],
                std::nullopt};
  if (weights[4 + 3 * index].numel() > 0) linear.bias = weights[4 + 3 * index];
  return linear;
}

// LlamaRMSNorm.forward
at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  auto states = hidden.to(at::kFloat);
  auto variance = states.pow(2).mean(-1, true);
  states = states * at::rsqrt(variance + eps);
  return weight * states.to(hidden.scalar_type());
}

// lean._rotated_projections after the input norm: query [1, Hq, n, D], key and value [1, Hkv, n, D]
std::tuple<at::Tensor, at::Tensor, at::Tensor> projections(const at::Tensor& hidden, const at::Tensor& cos,
                                                           const at::Tensor& sin, const std::vector<at::Tensor>& weights,
                                                           const std::vector<int64_t>& numbers, int64_t query_heads,
                                                           int64_t key_heads, double input_eps) {
  const int64_t head_dim = cos.size(-1), half = head_dim / 2;
  auto normed = rms_norm(hidden, weights[0], input_eps);
  auto heads = linear_of(weights, numbers, 0)(normed).view({1, hidden.size(1), -1, head_dim});
  auto query_key = heads.narrow(2, 0, query_heads + key_heads);
  auto value = heads.narrow(2, query_heads + key_heads, key_heads);
  auto rotated = at::cat({-query_key.narrow(-1, half, head_dim - half), query_key.narrow(-1, 0, half)}, -1);
  query_key = (query_key * cos.unsqueeze(2)) + (rotated * sin.unsqueeze(2));
  return {query_key.narrow(2, 0, query_heads).transpose(1, 2), query_key.narrow(2, query_heads, key_heads).transpose(1, 2),
          value.transpose(1, 2)};
}

// the rest of the layer from the attention's output [1, n, Hq, D]
at::Tensor finish(const at::Tensor& hidden, const at::Tensor& attended, const std::vector<at::Tensor>& weights,
                  const std::vector<int64_t>& numbers, double post_eps) {
  auto states = hidden + linear_of(weights, numbers, 1)(attended.reshape({1, hidden.size(1), -1}).contiguous());
  auto normed = rms_norm(states, weights[1], post_eps);
  auto gate_up = linear_of(weights, numbers, 2)(normed);
  const int64_t inner = gate_up.size(-1) / 2;
  auto gate = gate_up.narrow(-1, 0, inner), up = gate_up.narrow(-1, inner, inner);
  return states + linear_of(weights, numbers, 3)(at::silu(gate) * up);
}

}  // namespace

// row_attention.cpp
at::Tensor row_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, int64_t start,
                         double scale, const at::Tensor& allowed);
at::Tensor packed_row_attention(const at::Tensor& query, const at::Tensor& key_pool, const at::Tensor& value_pool,
                                c10::IntArrayRef requests, double scale);

// hidden [1, n, H]; cos, sin [1, n, D]; weights: input norm, post-attention norm, then (a, b, bias) for q/k/v, o,
// gate/up and down (bias: an empty tensor where none); numbers: (kind, tile rows, small rows, large calls) of each of
// those four linears (large calls: Tiles.large_mask); keys and values [1, Hkv, L, D]: the layer's cache before this
// forward. Returns the layer's output and the cache's keys and values after this forward.
std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weight_list,
    c10::IntArrayRef number_list, const at::Tensor& keys, const at::Tensor& values, int64_t query_heads,
    int64_t key_heads, double input_eps, double post_eps, double scale) {
  std::vector<at::Tensor> weights(weight_list.begin(), weight_list.end());
  std::vector<int64_t> numbers(number_list.begin(), number_list.end());
  auto [query, key, value] = projections(hidden, cos, sin, weights, numbers, query_heads, key_heads, input_eps);
  // DynamicLayer.update
  auto all_keys = at::cat({keys, key}, -2);
  auto all_values = at::cat({values, value}, -2);
  const int64_t start = all_keys.size(2) - hidden.size(1);
  auto attended = row_attention(query[0].transpose(0, 1), all_keys[0].transpose(0, 1), all_values[0].transpose(0, 1),
                                start, scale, at::Tensor());
  return {finish(hidden, attended.unsqueeze(0), weights, numbers, post_eps), all_keys, all_values};
}

// The serving engine's packed forward (adaflash_hf/serving/cache.py, ragged_attention_forward with the invariant
// attention): hidden [1, T, H] holds every request's new tokens; their keys and values are written to the pools
// [slots, capacity, Hkv, D] at (token_slots, token_positions), then attention.slot_invariant_attention (the row
// attention). requests: (slot, start, offset, length) per request. Returns the layer's output.
at::Tensor packed_layer(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                        at::TensorList weight_list, c10::IntArrayRef number_list, at::Tensor key_pool,
                        at::Tensor value_pool, const at::Tensor& token_slots, const at::Tensor& token_positions,
                        c10::IntArrayRef requests, int64_t query_heads, int64_t key_heads, double input_eps,
                        double post_eps, double scale) {
  std::vector<at::Tensor> weights(weight_list.begin(), weight_list.end());
  std::vector<int64_t> numbers(number_list.begin(), number_list.end());
  auto [query, key, value] = projections(hidden, cos, sin, weights, numbers, query_heads, key_heads, input_eps);
  // SlotKVStore.write
  c10::List<std::optional<at::Tensor>> where{token_slots, token_positions};
  key_pool.index_put_(where, key[0].transpose(0, 1));
  value_pool.index_put_(where, value[0].transpose(0, 1));
  auto attended = packed_row_attention(query[0].transpose(0, 1), key_pool, value_pool, requests, scale);
  return finish(hidden, attended.unsqueeze(0), weights, numbers, post_eps);
}

TORCH_LIBRARY(adaflash_native, m) {
  m.def(
      "decode_layer(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, int[] numbers, Tensor keys, "
      "Tensor values, int query_heads, int key_heads, float input_eps, float post_eps, float scale) -> "
      "(Tensor, Tensor, Tensor)");
  m.impl("decode_layer", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(decode_layer));
  m.def(
      "packed_layer(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, int[] numbers, Tensor(a!) key_pool, "
      "Tensor(b!) value_pool, Tensor token_slots, Tensor token_positions, int[] requests, int query_heads, "
      "int key_heads, float input_eps, float post_eps, float scale) -> Tensor");
  m.impl("packed_layer", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(packed_layer));
}
