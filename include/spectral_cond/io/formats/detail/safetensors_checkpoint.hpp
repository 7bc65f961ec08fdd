// spectral_cond::io: Checkpoint, one interface over a single .safetensors file or a sharded
// checkpoint (model.safetensors.index.json). Included by safetensors.hpp; do not include directly.
#pragma once

#include <spectral_cond/io/formats/safetensors.hpp>
#include <spectral_cond/io/paths.hpp>

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>

namespace spectral_cond {
namespace io {
namespace detail {

/// A shard name from an index: relative, no "..", no empty name.
inline bool safe_relative_name(const std::string& s) {
  if (s.empty() || s.front() == '/' || s.find('\0') != std::string::npos) return false;
  std::size_t start = 0;
  while (start <= s.size()) {
    const auto k = std::min(s.find('/', start), s.size());
    const std::string part = s.substr(start, k - start);
    if (part == ".." || part.empty()) return false;
    start = k + 1;
  }
  return true;
}

/// A sharded checkpoint's index (model.safetensors.index.json, pytorch_model.bin.index.json):
/// tensor -> shard, and the shard files, which must all exist as regular files.
struct ShardIndex {
  std::map<std::string, std::size_t> weight_map;  ///< tensor -> position in shard_paths
  std::vector<std::string> shard_paths;           ///< sorted by name (…-00001-of-N first)
};

/// Reads an index strictly (duplicate keys, a weight_map of strings, shard names relative and
/// inside the directory, every shard a regular file) and registers each shard as an input that
/// no output may replace, before any is opened. Throws IoError naming the index and the tensor.
inline ShardIndex read_shard_index(const std::string& p) {
  const MappedFile f(p);
  const char* b = reinterpret_cast<const char*>(f.data());
  const nlohmann::json j = parse_json_strict(b, b + f.size(), p + ": index");
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    throw IoError(p + ": index: no \"weight_map\" object");
  const std::string dir = parent_directory(p);
  std::map<std::string, std::string> wm;          // tensor -> shard name
  std::map<std::string, std::string> first_user;  // shard name -> a tensor naming it
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    if (!it->is_string())
      throw IoError(p + ": index: shard of tensor " + quote(it.key()) + " is not a string");
    const std::string shard = it->get<std::string>();
    if (!safe_relative_name(shard))
      throw IoError(p + ": index: tensor " + quote(it.key()) + " names shard " + quote(shard) +
                    ", not a relative path inside the directory");
    wm.emplace(it.key(), shard);
    first_user.emplace(shard, it.key());
  }
  ShardIndex out;
  std::map<std::string, std::size_t> shard_index;
  for (const auto& kv : first_user) {
    const std::string sp = join_path(dir, kv.first);
    struct stat st {};
    if (::stat(sp.c_str(), &st) != 0)
      throw IoError(p + ": index: shard " + quote(kv.first) + " of tensor " + quote(kv.second) +
                    " does not exist (" + sp + ")");
    if (!S_ISREG(st.st_mode))
      throw IoError(p + ": index: shard " + quote(kv.first) + " (" + sp + ") is " +
                    file_kind(st.st_mode) + ", not a regular file");
    note_input(st);  // never to be overwritten, even before it is opened
    shard_index.emplace(kv.first, out.shard_paths.size());
    out.shard_paths.push_back(sp);
  }
  for (const auto& kv : wm) out.weight_map.emplace(kv.first, shard_index.at(kv.second));
  return out;
}

/// Checks shard k, just opened, against the index both ways: it holds every tensor the index
/// maps to it, and every tensor it holds is mapped to it (one the index does not list would be
/// silently ignored, and dropped by a rewrite).
inline void check_shard(const ShardIndex& ix, std::size_t k, const std::vector<std::string>& names,
                        const std::string& index_path) {
  const std::string& sp = ix.shard_paths[k];
  const std::set<std::string> have(names.begin(), names.end());
  for (const auto& kv : ix.weight_map)
    if (kv.second == k && !have.count(kv.first))
      throw IoError(index_path + ": index: tensor " + quote(kv.first) + " is not in shard " + sp);
  for (const std::string& n : names) {
    auto it = ix.weight_map.find(n);
    if (it == ix.weight_map.end())
      throw IoError(sp + ": tensor " + quote(n) + " is not listed in the index " + index_path);
    if (it->second != k)
      throw IoError(sp + ": tensor " + quote(n) + " is also in this shard, but the index " +
                    index_path + " maps it to " + ix.shard_paths[it->second]);
  }
}

}  // namespace detail

/// All tensors of a checkpoint: a single .safetensors file, a model.safetensors.index.json
/// ("weight_map": tensor -> shard file, relative to the index's directory), or a directory
/// holding model.safetensors.index.json or model.safetensors (or exactly one *.safetensors).
/// Shards are memory-mapped on first use and stay mapped; nothing is read in bulk, so a 7B
/// checkpoint can be analysed layer by layer. Shard opening is guarded by a mutex.
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& path) : mutex_(std::make_unique<std::mutex>()) {
    std::string p = path;
    if (is_directory(p)) p = pick_in_directory(p);
    if (has_suffix(p, ".json")) {
      open_index(p);
    } else {
      path_ = p;
      shards_.push_back(std::make_unique<SafetensorsFile>(p));
      ix_.shard_paths.push_back(p);
      for (const auto& t : shards_[0]->tensors()) ix_.weight_map.emplace(t.name, 0);
    }
  }

  /// The file opened: the .safetensors file or the index.
  const std::string& path() const { return path_; }
  bool sharded() const { return sharded_; }
  /// Shard files, sorted by name.
  const std::vector<std::string>& shard_paths() const { return ix_.shard_paths; }

  /// All tensor names, sorted.
  std::vector<std::string> names() const {
    std::vector<std::string> n;
    for (const auto& kv : ix_.weight_map) n.push_back(kv.first);
    return n;
  }
  bool contains(const std::string& name) const { return ix_.weight_map.count(name) != 0; }

  /// The shard holding `name` (opened now if needed); IoError when the index lacks it.
  const SafetensorsFile& shard_for(const std::string& name) const {
    auto it = ix_.weight_map.find(name);
    if (it == ix_.weight_map.end())
      throw IoError(path_ + ": checkpoint: no tensor " + detail::quote(name));
    return shard(it->second);
  }

  const TensorInfo& info(const std::string& name) const { return shard_for(name).info(name); }
  ByteView bytes(const std::string& name) const { return shard_for(name).bytes(name); }
  template <typename S>
  Mat<S> matrix(const std::string& name) const {
    return shard_for(name).template matrix<S>(name);
  }
  template <typename S>
  std::vector<S> values(const std::string& name) const {
    return shard_for(name).template values<S>(name);
  }

  /// Maps every shard now and checks the index against each (every tensor it names is there);
  /// reads no tensor data. Without it, a bad shard is reported when first used.
  void open_all() const {
    for (std::size_t k = 0; k < shards_.size(); ++k) (void)shard(k);
  }

  /// "__metadata__" of the single file, or of the first shard of a sharded checkpoint.
  const std::map<std::string, std::string>& metadata() const {
    if (ix_.shard_paths.empty()) return empty_metadata_;
    return shard(0).metadata();
  }

 private:
  static std::string pick_in_directory(const std::string& dir) {
    for (const char* f : {"model.safetensors.index.json", "model.safetensors"}) {
      const std::string c = join_path(dir, f);
      if (is_regular_file(c)) return c;
    }
    // Otherwise exactly one *.safetensors.index.json, or else exactly one *.safetensors.
    std::vector<std::string> indexes, files, unsupported;
    if (DIR* d = ::opendir(dir.c_str())) {
      while (const dirent* e = ::readdir(d)) {
        const std::string n = e->d_name;
        if (has_suffix(n, ".safetensors.index.json")) indexes.push_back(n);
        if (has_suffix(n, ".safetensors")) files.push_back(n);
        if (detail::unsupported_format_of_name(n) != nullptr) unsupported.push_back(n);
      }
      ::closedir(d);
    }
    if (indexes.size() == 1) return join_path(dir, indexes[0]);
    if (indexes.empty() && files.size() == 1) return join_path(dir, files[0]);
    if (indexes.empty() && files.empty() && !unsupported.empty()) {
      std::sort(unsupported.begin(), unsupported.end());
      const std::string f = join_path(dir, unsupported[0]);
      throw IoError(detail::unsupported_message(f, detail::unsupported_format_of_name(f)) +
                    " (the directory holds no .safetensors file)");
    }
    throw IoError(dir +
                  ": checkpoint: directory holds no model.safetensors.index.json or "
                  "model.safetensors, and not exactly one other index or .safetensors "
                  "file");
  }

  void open_index(const std::string& p) {
    path_ = p;
    sharded_ = true;
    ix_ = detail::read_shard_index(p);
    shards_.resize(ix_.shard_paths.size());
  }

  /// Opens shard k on first use and checks it against the index (detail::check_shard).
  const SafetensorsFile& shard(std::size_t k) const {
    std::lock_guard<std::mutex> lock(*mutex_);
    if (!shards_[k]) {
      auto f = std::make_unique<SafetensorsFile>(ix_.shard_paths[k]);
      if (sharded_) {
        std::vector<std::string> names;
        for (const auto& t : f->tensors()) names.push_back(t.name);
        detail::check_shard(ix_, k, names, path_);
      }
      shards_[k] = std::move(f);
    }
    return *shards_[k];
  }

  std::string path_;
  bool sharded_ = false;
  detail::ShardIndex ix_;  // tensor -> shard, and the shard files
  mutable std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::unique_ptr<std::mutex> mutex_;
  std::map<std::string, std::string> empty_metadata_;
};

}  // namespace io
}  // namespace spectral_cond
