// spectral_cond::io: strict JSON for untrusted files (safetensors headers, sharded indexes,
// config.json). Plain nlohmann::json keeps the last of two equal keys; here a duplicate key in
// any object, at any depth, is an error, and so is nesting deeper than kMaxJsonDepth (no file
// this library reads nests beyond 3).
#pragma once

#include <spectral_cond/io/error.hpp>

#include <nlohmann/json.hpp>

#include <set>
#include <string>
#include <vector>

namespace spectral_cond {
namespace io {

/// Deepest nesting of objects and arrays accepted by parse_json_strict.
inline constexpr int kMaxJsonDepth = 64;

namespace detail {

/// The first line of an exception's text, with control and non-ASCII bytes escaped.
inline std::string json_error_text(const std::exception& e) {
  const std::string q = quote(e.what(), 300);
  return q.substr(1, q.size() - 2);
}

}  // namespace detail

namespace detail {

/// A SAX pass over the text that records the first duplicate key (and the keys above it) and
/// whether the nesting exceeds kMaxJsonDepth; linear in the text (nlohmann's callback parser is
/// not: it is quadratic in the number of keys of an object).
class StrictJsonChecker {
 public:
  using json = nlohmann::json;
  bool null() { return value(); }
  bool boolean(bool) { return value(); }
  bool number_integer(json::number_integer_t) { return value(); }
  bool number_unsigned(json::number_unsigned_t) { return value(); }
  bool number_float(json::number_float_t, const json::string_t&) { return value(); }
  bool string(json::string_t&) { return value(); }
  bool binary(json::binary_t&) { return value(); }
  bool start_object(std::size_t) { return open(true); }
  bool end_object() { return close(); }
  bool start_array(std::size_t) { return open(false); }
  bool end_array() { return close(); }
  bool key(json::string_t& k) {
    if (!frames_.empty() && frames_.back().is_object && !frames_.back().keys.insert(k).second) {
      duplicate = k;
      for (std::size_t i = 1; i < frames_.size(); ++i)
        where += (where.empty() ? " in " : " / ") + quote(frames_[i].name);
      return false;  // stop: the duplicate is the error
    }
    last_key_ = k;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) {
    error = json_error_text(ex);
    return false;
  }

  std::string duplicate, where, error;
  bool too_deep = false;

 private:
  struct Frame {
    bool is_object;
    std::string name;  // the key that opened it
    std::set<std::string> keys;
  };
  bool value() { return true; }
  bool open(bool is_object) {
    if (frames_.size() >= static_cast<std::size_t>(kMaxJsonDepth)) {
      too_deep = true;
      return false;
    }
    frames_.push_back({is_object, last_key_, {}});
    return true;
  }
  bool close() {
    if (!frames_.empty()) frames_.pop_back();
    return true;
  }
  std::vector<Frame> frames_;
  std::string last_key_;
};

}  // namespace detail

/// Parses [begin, end) as JSON, rejecting duplicate keys in any object and nesting deeper than
/// kMaxJsonDepth. Throws IoError("<label>: <what>: ...") naming the duplicate key and where it
/// is (the chain of keys above it, e.g. "in 'weight_map'"). Two linear passes: a SAX check,
/// then nlohmann's parser.
inline nlohmann::json parse_json_strict(const char* begin, const char* end,
                                        const std::string& label) {
  detail::StrictJsonChecker check;
  const bool ok = nlohmann::json::sax_parse(begin, end, &check);
  if (check.too_deep)
    throw IoError(label + ": JSON nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  if (!check.duplicate.empty())
    throw IoError(label + ": duplicate key " + detail::quote(check.duplicate) + check.where);
  if (!ok || !check.error.empty())
    throw IoError(label + ": not valid JSON: " +
                  (check.error.empty() ? std::string("parse failed") : check.error));
  try {
    return nlohmann::json::parse(begin, end);
  } catch (const nlohmann::json::exception& ex) {
    throw IoError(label + ": not valid JSON: " + detail::json_error_text(ex));
  }
}

}  // namespace io
}  // namespace spectral_cond
