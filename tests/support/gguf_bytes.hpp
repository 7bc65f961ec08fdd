// GGUF files written byte by byte for the tests (test_gguf.cpp's hostile headers,
// test_attention_config.cpp's llama biases): little-endian fields in the order the format
// defines them, nothing checked, so that malformed files are as easy to write as valid ones.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace sc_test {

/// Little-endian GGUF bytes, field by field.
struct Gguf {
  std::vector<std::uint8_t> b;
  Gguf& raw(const void* p, std::size_t n) {
    const auto* c = static_cast<const std::uint8_t*>(p);
    b.insert(b.end(), c, c + n);
    return *this;
  }
  Gguf& le(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) b.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
    return *this;
  }
  Gguf& u8(std::uint64_t v) { return le(v, 1); }
  Gguf& u32(std::uint64_t v) { return le(v, 4); }
  Gguf& u64(std::uint64_t v) { return le(v, 8); }
  Gguf& str(const std::string& s) { return u64(s.size()).raw(s.data(), s.size()); }
  Gguf& header(std::uint64_t n_tensors, std::uint64_t n_kv, std::uint32_t version = 3) {
    return raw("GGUF", 4).u32(version).u64(n_tensors).u64(n_kv);
  }
  Gguf& kv_u32(const std::string& key, std::uint32_t v) { return str(key).u32(4).u32(v); }
  Gguf& kv_f32(const std::string& key, float v) { return str(key).u32(6).f32(v); }
  Gguf& kv_str(const std::string& key, const std::string& v) { return str(key).u32(8).str(v); }
  /// A tensor's info: name, ne (ggml order: the row length first), ggml type, data offset.
  Gguf& tensor(const std::string& name, const std::vector<std::uint64_t>& ne, std::uint32_t type,
               std::uint64_t offset) {
    str(name).u32(ne.size());
    for (std::uint64_t d : ne) u64(d);
    return u32(type).u64(offset);
  }
  Gguf& pad(std::size_t align = 32) {
    while (b.size() % align != 0) b.push_back(0);
    return *this;
  }
  Gguf& f32(float v) {
    std::uint32_t u = 0;
    std::memcpy(&u, &v, 4);
    return u32(u);
  }
  Gguf& zeros(std::size_t n) {
    b.insert(b.end(), n, 0);
    return *this;
  }
};

}  // namespace sc_test
