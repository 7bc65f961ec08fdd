// libFuzzer target: the strict JSON parser (include/spectral_cond/io/json.hpp) that reads
// safetensors headers, sharded indexes and config.json, then the config reader on its result.
#include <spectral_cond/io/json.hpp>
#include <spectral_cond/io/layouts/detect.hpp>

#include <cstddef>
#include <cstdint>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace io = spectral_cond::io;
  const char* b = reinterpret_cast<const char*>(data);
  nlohmann::json j;
  try {
    j = io::parse_json_strict(b, b + size, "fuzz.json");
  } catch (const io::IoError&) {
    return 0;
  }
  // What the parser accepted is valid JSON without duplicate keys: its own serialisation parses
  // again, strictly, to the same value.
  const std::string again = j.dump();
  try {
    if (io::parse_json_strict(again.data(), again.data() + again.size(), "again") != j)
      __builtin_trap();
  } catch (const io::IoError&) {
    __builtin_trap();
  }
  try {
    const io::HeadConfig c = io::head_config_from_json(j, "fuzz.json");
    if (c.heads < 0 || c.kv_heads < 0 || c.hidden < 0) __builtin_trap();
  } catch (const io::IoError&) {
  }
  return 0;
}
