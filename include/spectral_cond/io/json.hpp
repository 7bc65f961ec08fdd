// spectral_cond::io: strict JSON for untrusted files (safetensors headers, sharded indexes,
// config.json). Plain nlohmann::json keeps the last of two equal keys; here a duplicate key in
// any object, at any depth, is an error, and so is nesting deeper than kMaxJsonDepth (no file
// this library reads nests beyond 3).
#pragma once

#include <spectral_cond/io/error.hpp>

#include <nlohmann/json.hpp>

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

/// A SAX handler that builds the document, like nlohmann's own DOM parser, and checks each key
/// against the object it goes into (one lookup in that object's map) and the nesting depth:
/// one linear pass. (nlohmann's callback parser, the other way to see every key, is quadratic in
/// the number of keys of an object.)
class StrictJsonBuilder {
 public:
  using json = nlohmann::json;
  explicit StrictJsonBuilder(json& root) : root_(root) {}

  bool null() { return put(json(nullptr)); }
  bool boolean(bool v) { return put(json(v)); }
  bool number_integer(json::number_integer_t v) { return put(json(v)); }
  bool number_unsigned(json::number_unsigned_t v) { return put(json(v)); }
  bool number_float(json::number_float_t v, const json::string_t&) { return put(json(v)); }
  bool string(json::string_t& v) { return put(json(std::move(v))); }
  bool binary(json::binary_t& v) { return put(json::binary(std::move(v))); }
  bool start_object(std::size_t) { return open(json::object()); }
  bool start_array(std::size_t) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(json::string_t& k) {
    json& obj = *stack_.back();
    if (obj.contains(k)) {
      duplicate = k;
      for (std::size_t i = 1; i < names_.size(); ++i)
        where += (where.empty() ? " in " : " / ") + quote(names_[i]);
      return false;  // stop: the duplicate is the error
    }
    key_ = std::move(k);
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) {
    error = json_error_text(ex);
    return false;
  }

  std::string duplicate, where, error;
  bool too_deep = false;

 private:
  /// Puts v where the parser is (the root, the pending key of an object, the end of an array);
  /// returns where it went.
  json* place(json&& v) {
    if (stack_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    json& top = *stack_.back();
    if (top.is_object()) return &(top[key_] = std::move(v));
    top.push_back(std::move(v));
    return &top.back();
  }
  bool put(json&& v) {
    place(std::move(v));
    return true;
  }
  bool open(json&& v) {
    if (stack_.size() >= static_cast<std::size_t>(kMaxJsonDepth)) {
      too_deep = true;
      return false;
    }
    const bool in_object = !stack_.empty() && stack_.back()->is_object();
    names_.push_back(in_object ? key_ : std::string());
    stack_.push_back(place(std::move(v)));
    return true;
  }
  bool close() {
    stack_.pop_back();
    names_.pop_back();
    return true;
  }

  json& root_;
  std::vector<json*> stack_;        // the open objects and arrays, innermost last
  std::vector<std::string> names_;  // the key each was opened under ("" in an array)
  std::string key_;
};

}  // namespace detail

/// Parses [begin, end) as JSON, rejecting duplicate keys in any object and nesting deeper than
/// kMaxJsonDepth. Throws IoError("<label>: <what>: ...") naming the duplicate key and where it
/// is (the chain of keys above it, e.g. "in 'weight_map'"). One linear pass.
inline nlohmann::json parse_json_strict(const char* begin, const char* end,
                                        const std::string& label) {
  nlohmann::json root;
  detail::StrictJsonBuilder b(root);
  bool ok = false;
  try {
    ok = nlohmann::json::sax_parse(begin, end, &b);
  } catch (const nlohmann::json::exception& ex) {
    throw IoError(label + ": not valid JSON: " + detail::json_error_text(ex));
  }
  if (b.too_deep)
    throw IoError(label + ": JSON nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  if (!b.duplicate.empty())
    throw IoError(label + ": duplicate key " + detail::quote(b.duplicate) + b.where);
  if (!ok || !b.error.empty())
    throw IoError(label +
                  ": not valid JSON: " + (b.error.empty() ? std::string("parse failed") : b.error));
  return root;
}

}  // namespace io
}  // namespace spectral_cond
