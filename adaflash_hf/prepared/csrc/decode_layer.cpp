// A decoder layer of a prepared Llama target over the new tokens of one sequence, as one call: the ATen ops the lean
// layer (adaflash_hf/prepared/lean.py) and the invariant attention (adaflash_hf/prepared/attention.py) run for those
// tokens, in the same order, on the same shapes and dtypes, each linear and attention block in the tiles the Python
// code calls it in (adaflash_hf/prepared/tiles.py), so the result is bitwise the Python layer's; only the
// interpreter's time between the ops goes. adaflash_hf/prepared/native.py says what the arguments are and when a
// forward runs here.

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

// the causal rows of `length` queries at positions start.. of a GQA group over keys 0..span-1, in a tile of `size`
// rows: row g * length + q sees keys up to start + q; rows past group * length see every key
void causal_rows(bool* entries, int64_t size, int64_t span, int64_t group, int64_t start, int64_t length) {
  for (int64_t row = 0; row < size; ++row) {
    const int64_t seen = row < group * length ? start + row % length : span - 1;
    for (int64_t key = 0; key < span; ++key) entries[row * span + key] = key <= seen;
  }
}

// the additive mask SDPA makes of a boolean one at each call (0 where a row sees a key, -inf elsewhere, in the query's
// dtype), made once for many calls
at::Tensor additive_mask(const at::Tensor& allowed, const at::TensorOptions& options) {
  return at::zeros(allowed.sizes(), options).masked_fill_(allowed.logical_not(), -INFINITY);
}

// attention.sequence_attention(query [Hq, n, D], keys/values [Hkv, L, D], start = L - n, scale), no extra mask:
// each key block's queries in the calls of that block's tiles: tile_rows[2 * (block - first block)] rows each, or its
// large calls (the next entry: Tiles.large_mask)
at::Tensor sequence_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                              double scale, int64_t key_block, const std::vector<int64_t>& tile_rows) {
  const int64_t heads = query.size(0), count = query.size(1), dim = query.size(2);
  const int64_t key_heads = keys.size(0), length = keys.size(1), start = length - count;
  const int64_t group = heads / key_heads;
  const int64_t first_block = start / key_block, last_block = (start + count - 1) / key_block;
  std::vector<at::Tensor> outputs;
  for (int64_t block = first_block; block <= last_block; ++block) {
    const int64_t first = std::max(start, block * key_block) - start;
    const int64_t last = std::min(start + count, (block + 1) * key_block) - start;
    const int64_t rows = last - first, span = (block + 1) * key_block;
    const int64_t size = tile_rows[2 * (block - first_block)], large = tile_rows[2 * (block - first_block) + 1];
    // _keys_of_block: the first `span` positions, zeros past the sequence
    at::Tensor block_keys, block_values;
    const int64_t kept = std::min(span, length), missing = span - kept;
    if (missing > 0) {
      block_keys = at::constant_pad_nd(keys.narrow(1, 0, kept), {0, 0, 0, missing}, 0);
      block_values = at::constant_pad_nd(values.narrow(1, 0, kept), {0, 0, 0, missing}, 0);
    } else {
      block_keys = keys.narrow(1, 0, span).clone(at::MemoryFormat::Contiguous);
      block_values = values.narrow(1, 0, span).clone(at::MemoryFormat::Contiguous);
    }
    // rows (head of the GQA group, query), each query seeing keys up to its own position; padding rows see all
    const int64_t total = group * rows, whole = (total + size - 1) / size * size;
    auto tiles = at::empty({key_heads, whole, dim}, query.options());
    tiles.narrow(1, 0, total).copy_(query.narrow(1, first, rows).reshape({key_heads, total, dim}));
    tiles.narrow(1, total, whole - total).zero_();
    auto allowed = at::empty({whole, span}, query.options().dtype(at::kBool));
    causal_rows(allowed.data_ptr<bool>(), whole, span, group, start + first, rows);
    auto mask = additive_mask(allowed, query.options());
    std::vector<at::Tensor> parts;
    for (int64_t offset = 0; offset < whole;) {
      const int64_t call = call_rows(size, large, whole - offset);
      auto tile = tiles.narrow(1, offset, call);
      // tiles._tile: a fresh copy where the slice is not contiguous or not 64-byte aligned
      if (!tile.is_contiguous() || reinterpret_cast<uintptr_t>(tile.data_ptr()) % 64)
        tile = tile.clone(at::MemoryFormat::Contiguous);
      parts.push_back(at::scaled_dot_product_attention(tile.unsqueeze(0), block_keys.unsqueeze(0),
                                                       block_values.unsqueeze(0), mask.narrow(0, offset, call), 0.0,
                                                       false, scale)[0]);
      offset += call;
    }
    auto attended = parts.size() == 1 ? parts[0] : at::cat(parts, 1);
    outputs.push_back(attended.narrow(1, 0, total).reshape({heads, rows, dim}));
  }
  return outputs.size() == 1 ? outputs[0] : at::cat(outputs, 1);
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

// hidden [1, n, H]; cos, sin [1, n, D]; weights: input norm, post-attention norm, then (a, b, bias) for q/k/v, o,
// gate/up and down (bias: an empty tensor where none); numbers: (kind, tile rows, small rows, large calls) of each of
// those four linears (large calls: Tiles.large_mask); keys and values [1, Hkv, L, D]: the layer's cache before this
// forward; attention_rows: the attention tiles' rows and large calls for each key block the new tokens fall in.
// Returns the layer's output and the cache's keys and values after this forward.
std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weight_list,
    c10::IntArrayRef number_list, const at::Tensor& keys, const at::Tensor& values, int64_t query_heads,
    int64_t key_heads, double input_eps, double post_eps, double scale, int64_t key_block,
    c10::IntArrayRef attention_rows) {
  std::vector<at::Tensor> weights(weight_list.begin(), weight_list.end());
  std::vector<int64_t> numbers(number_list.begin(), number_list.end());
  auto [query, key, value] = projections(hidden, cos, sin, weights, numbers, query_heads, key_heads, input_eps);
  // DynamicLayer.update
  auto all_keys = at::cat({keys, key}, -2);
  auto all_values = at::cat({values, value}, -2);
  std::vector<int64_t> rows(attention_rows.begin(), attention_rows.end());
  auto attended = sequence_attention(query[0], all_keys[0], all_values[0], scale, key_block, rows);
  return {finish(hidden, attended.transpose(0, 1).unsqueeze(0), weights, numbers, post_eps), all_keys, all_values};
}

// What packed_layer's stacked calls take, made once per packed forward (every layer has the same geometry); see
// packed_layer for `requests` and `spans`, `like` gives the attention's dtype. Per stacked key span, in the order of
// its first request, six tensors: the slots of the call's entries [count]; `gather` [count * Hkv * rows], for each
// row of the stacked tile [count, Hkv, rows, D] the row of the query [T * Hq (+ 1 zero row), D] it holds (the zero
// row past a request's group * length rows); the additive mask [count, 1, rows, span] of the query's dtype, 0 where
// a row sees a key and -inf elsewhere (what SDPA makes of the boolean mask attention.stacked_block_attention gives
// it); `source` and `destination`: the rows of the attended tile and of the output [T * Hq, D] that take them;
// `first`: [first slot] where the entries are the pools' slots first.. (attention.stacked_entries: a view, an entry
// of no request all zero rows that see every key), empty where they are the requests in turn, gathered.
std::vector<at::Tensor> packed_plan(const at::Tensor& like, c10::IntArrayRef requests, c10::IntArrayRef spans,
                                    int64_t token_count, int64_t query_heads, int64_t key_heads, int64_t key_block) {
  const int64_t group = query_heads / key_heads, zero_row = token_count * query_heads;
  auto longs = at::TensorOptions().dtype(at::kLong);
  std::vector<int64_t> order;
  for (size_t i = 0; i < requests.size(); i += 5) {
    if (!requests[i + 4]) continue;
    const int64_t span = (requests[i + 1] / key_block + 1) * key_block;
    if (std::find(order.begin(), order.end(), span) == order.end()) order.push_back(span);
  }
  std::vector<at::Tensor> plan;
  for (const int64_t span : order) {
    int64_t rows = 0;
    for (size_t i = 0; i < spans.size(); i += 4)
      if (spans[i] == span) rows = spans[i + 3];
    TORCH_CHECK(rows > 0, "packed_plan: no stacking rows given for the key span ", span);
    std::vector<size_t> members;  // the requests stacked in this span's call
    int64_t low = INT64_MAX, high = -1;
    for (size_t i = 0; i < requests.size(); i += 5)
      if (requests[i + 4] && (requests[i + 1] / key_block + 1) * key_block == span) {
        members.push_back(i);
        low = std::min(low, requests[i]);
        high = std::max(high, requests[i]);
      }
    const int64_t requested = members.size();
    const bool view = 2 * (high - low + 1 - requested) <= requested;  // attention.stacked_entries
    const int64_t count = view ? high - low + 1 : requested;
    std::vector<int64_t> entry_of(requested), slots(count);
    for (int64_t index = 0; index < requested; ++index) entry_of[index] = view ? requests[members[index]] - low : index;
    for (int64_t entry = 0; entry < count; ++entry) slots[entry] = view ? low + entry : requests[members[entry]];
    auto allowed = at::empty({count, 1, rows, span}, like.options().dtype(at::kBool));
    std::vector<int64_t> gather(count * key_heads * rows, zero_row), source, destination;
    for (int64_t entry = 0; entry < count; ++entry)  // entries of no request: every row sees every key
      causal_rows(allowed.data_ptr<bool>() + entry * rows * span, rows, span, group, 0, 0);
    for (int64_t index = 0; index < requested; ++index) {
      const size_t i = members[index];
      const int64_t entry = entry_of[index];
      const int64_t start = requests[i + 1], offset = requests[i + 2], length = requests[i + 3];
      causal_rows(allowed.data_ptr<bool>() + entry * rows * span, rows, span, group, start, length);
      // tile row r of key head h: query[offset + r % length, h * group + r / length] (the GQA group's heads in
      // turn, as query[offset : offset + length].transpose(0, 1).reshape(Hkv, group * length, D) orders them)
      for (int64_t head = 0; head < key_heads; ++head)
        for (int64_t row = 0; row < group * length; ++row)
          gather[(entry * key_heads + head) * rows + row] =
              (offset + row % length) * query_heads + head * group + row / length;
      for (int64_t token = 0; token < length; ++token)
        for (int64_t head = 0; head < query_heads; ++head) {
          destination.push_back((offset + token) * query_heads + head);
          source.push_back((entry * key_heads + head / group) * rows + (head % group) * length + token);
        }
    }
    plan.push_back(at::tensor(slots, longs));
    plan.push_back(at::tensor(gather, longs));
    plan.push_back(additive_mask(allowed, like.options()));
    plan.push_back(at::tensor(source, longs));
    plan.push_back(at::tensor(destination, longs));
    plan.push_back(view ? at::tensor(std::vector<int64_t>{low}, longs) : at::empty({0}, longs));
  }
  return plan;
}

// The serving engine's packed forward (adaflash_hf/serving/cache.py, ragged_attention_forward with the invariant
// attention): hidden [1, T, H] holds every request's new tokens; their keys and values are written to the pools
// [slots, capacity, Hkv, D] at (token_slots, token_positions), then attention.slot_invariant_attention. requests:
// (slot, start, offset, length, stacked) per request, stacked = 1 where its rows go in its key block's stacked call;
// spans: (span, attention tile rows, large calls, stacking rows) of every key block a request touches; stacked:
// packed_plan's tensors for these. Returns the layer's output.
at::Tensor packed_layer(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                        at::TensorList weight_list, c10::IntArrayRef number_list, at::Tensor key_pool,
                        at::Tensor value_pool, const at::Tensor& token_slots, const at::Tensor& token_positions,
                        c10::IntArrayRef requests, c10::IntArrayRef spans, at::TensorList stacked,
                        int64_t query_heads, int64_t key_heads, double input_eps, double post_eps, double scale,
                        int64_t key_block) {
  std::vector<at::Tensor> weights(weight_list.begin(), weight_list.end());
  std::vector<int64_t> numbers(number_list.begin(), number_list.end());
  auto [query4, key, value] = projections(hidden, cos, sin, weights, numbers, query_heads, key_heads, input_eps);
  // SlotKVStore.write
  c10::List<std::optional<at::Tensor>> where{token_slots, token_positions};
  key_pool.index_put_(where, key[0].transpose(0, 1));
  value_pool.index_put_(where, value[0].transpose(0, 1));
  auto query = query4[0].transpose(0, 1);  // [T, Hq, D]
  const int64_t tokens = query.size(0), dim = query.size(2);
  auto out = at::empty({tokens, query_heads, dim}, query.options());
  auto tile_rows = [&](int64_t span, int64_t field) {
    for (size_t i = 0; i < spans.size(); i += 4)
      if (spans[i] == span) return spans[i + field];
    TORCH_CHECK(false, "packed_layer: no tile rows given for the key span ", span);
  };
  for (size_t i = 0; i < requests.size(); i += 5) {
    if (requests[i + 4]) continue;
    const int64_t slot = requests[i], start = requests[i + 1], offset = requests[i + 2], length = requests[i + 3];
    std::vector<int64_t> rows;
    for (int64_t block = start / key_block; block <= (start + length - 1) / key_block; ++block)
      for (int64_t field = 1; field <= 2; ++field) rows.push_back(tile_rows((block + 1) * key_block, field));
    const int64_t end = start + length;
    auto attended = sequence_attention(query.narrow(0, offset, length).transpose(0, 1),
                                       key_pool[slot].narrow(0, 0, end).transpose(0, 1),
                                       value_pool[slot].narrow(0, 0, end).transpose(0, 1), scale, key_block, rows);
    out.narrow(0, offset, length).copy_(attended.transpose(0, 1));
  }
  // attention.stacked_block_attention, one call per key span: the tile gathered, its keys and values a view of the
  // pools or gathered (packed_plan)
  if (!stacked.empty()) {
    auto rows_of_query = at::cat({query.reshape({-1, dim}), at::zeros({1, dim}, query.options())});
    auto out_rows = out.view({-1, dim});
    for (size_t s = 0; s < stacked.size(); s += 6) {
      const auto &slots = stacked[s], &gather = stacked[s + 1], &mask = stacked[s + 2];
      const int64_t count = slots.size(0), rows = mask.size(2), span = mask.size(3);
      auto keys = key_pool.narrow(1, 0, span), values = value_pool.narrow(1, 0, span);
      if (stacked[s + 5].numel()) {  // a range of slots: a view
        const int64_t first = stacked[s + 5].item<int64_t>();
        keys = keys.narrow(0, first, count);
        values = values.narrow(0, first, count);
      } else {
        keys = keys.index_select(0, slots);
        values = values.index_select(0, slots);
      }
      auto block_keys = keys.transpose(1, 2), block_values = values.transpose(1, 2);
      auto tile = rows_of_query.index_select(0, gather).view({count, key_heads, rows, dim});
      auto attended = at::scaled_dot_product_attention(tile, block_keys, block_values, mask, 0.0, false, scale);
      out_rows.index_copy_(0, stacked[s + 4], attended.view({-1, dim}).index_select(0, stacked[s + 3]));
    }
  }
  return finish(hidden, out.unsqueeze(0), weights, numbers, post_eps);
}

TORCH_LIBRARY(adaflash_native, m) {
  m.def(
      "decode_layer(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, int[] numbers, Tensor keys, "
      "Tensor values, int query_heads, int key_heads, float input_eps, float post_eps, float scale, int key_block, "
      "int[] attention_rows) -> (Tensor, Tensor, Tensor)");
  m.impl("decode_layer", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(decode_layer));
  m.def(
      "packed_layer(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, int[] numbers, Tensor(a!) key_pool, "
      "Tensor(b!) value_pool, Tensor token_slots, Tensor token_positions, int[] requests, int[] spans, "
      "Tensor[] stacked, int query_heads, int key_heads, float input_eps, float post_eps, float scale, int key_block) -> Tensor");
  m.impl("packed_layer", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(packed_layer));
  m.def(
      "packed_plan(Tensor like, int[] requests, int[] spans, int token_count, int query_heads, int key_heads, "
      "int key_block) -> Tensor[]");
  m.impl("packed_plan", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(packed_plan));
}
