// spectral-cond: one `analyze` report from the JSON reports of its shards (`analyze --shard i/n
// --format json`, or the ranks of spectral-cond-mpi). The merged document is the one the
// unsharded run writes, field for field (docs/cli.md, "Sharded and distributed runs"): every
// shard computes the same whole-matrix statistics and only its own κ(J) work items, so the
// documents must agree everywhere except in each layer's "jacobian" list, whose entries are
// united and ordered by head.
#pragma once

#include "analysis_format.hpp"
#include "inputs.hpp"
#include "report_json.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace spectral_cond::engine {

namespace detail_merge {

/// The layer fields that only layers with κ(J) entries carry (analysis_format.hpp).
inline const char* const kJacobianFields[] = {"jacobian", "biases", "rope", "rope_source"};

/// The document without "shard" and without the layers' "jacobian" lists: what every shard
/// of one run computes alike.
inline nlohmann::json common_part(nlohmann::json doc) {
  doc.erase("shard");
  for (nlohmann::json& c : doc["checkpoints"])
    for (nlohmann::json& l : c["layers"]) l.erase("jacobian");
  return doc;
}

/// Throws BadInput "<name>: ..." unless `doc` is a shard of an analyze report of this version;
/// returns its shard index and sets `count`.
inline std::uint64_t shard_of(const nlohmann::json& doc, const std::string& name,
                              std::uint64_t& count) {
  auto bad = [&](const std::string& why) { return BadInput(name + ": " + why); };
  if (!doc.is_object() || doc.value("tool", std::string()) != "spectral-cond analyze")
    throw bad("not a report of spectral-cond analyze --format json");
  if (doc.value("format_version", -1) != kAnalyzeFormatVersion)
    throw bad("format_version must be " + std::to_string(kAnalyzeFormatVersion) +
              " (written by another version of spectral-cond?)");
  const auto s = doc.find("shard");
  if (s == doc.end() || !s->is_object() || !(*s)["index"].is_number_unsigned() ||
      !(*s)["count"].is_number_unsigned())
    throw bad(
        "not a shard: it has no \"shard\": {\"index\", \"count\"} (run analyze with "
        "--shard i/n --format json)");
  count = (*s)["count"].get<std::uint64_t>();
  const std::uint64_t index = (*s)["index"].get<std::uint64_t>();
  if (count < 2 || index >= count)
    throw bad("shard " + std::to_string(index) + "/" + std::to_string(count) +
              " is not a valid shard");
  const auto cs = doc.find("checkpoints");
  if (cs == doc.end() || !cs->is_array()) throw bad("no \"checkpoints\" list");
  for (const nlohmann::json& c : *cs) {
    if (!c.is_object() || !c.contains("layers") || !c["layers"].is_array())
      throw bad("a checkpoint without a \"layers\" list");
    for (const nlohmann::json& l : c["layers"])
      if (!l.is_object() || (l.contains("jacobian") && !l["jacobian"].is_array()))
        throw bad("a layer that is not an object, or whose \"jacobian\" is not a list");
  }
  return index;
}

}  // namespace detail_merge

/// Merges the shard documents `docs` (parsed; `names` name them in messages) into the unsharded
/// report. Throws BadInput naming the file when a shard is missing, repeated, from another
/// run (any difference outside the κ(J) lists, reported with its JSON pointer), or holds a head
/// another shard holds.
inline nlohmann::json merge_shards(const std::vector<nlohmann::json>& docs,
                                   const std::vector<std::string>& names) {
  using namespace detail_merge;
  if (docs.empty()) throw BadInput("merge: no shard reports given");
  std::uint64_t count = 0;
  std::vector<std::uint64_t> index(docs.size());
  for (std::size_t f = 0; f < docs.size(); ++f) {
    std::uint64_t n = 0;
    index[f] = shard_of(docs[f], names[f], n);
    if (f == 0) count = n;
    if (n != count)
      throw BadInput(names[f] + ": shard " + std::to_string(index[f]) + "/" + std::to_string(n) +
                     " is not one of the " + std::to_string(count) + " shards of " + names[0]);
  }
  if (docs.size() != count)
    throw BadInput("merge: " + std::to_string(docs.size()) + " reports given for the " +
                   std::to_string(count) + " shards of " + names[0] + " (each shard once)");
  std::vector<std::size_t> by_index(docs.size(), docs.size());  // shard -> report
  for (std::size_t f = 0; f < docs.size(); ++f) {
    std::size_t& slot = by_index[static_cast<std::size_t>(index[f])];
    if (slot != docs.size())
      throw BadInput(names[f] + ": shard " + std::to_string(index[f]) + "/" +
                     std::to_string(count) + " repeats " + names[slot]);
    slot = f;
  }

  const nlohmann::json first = common_part(docs[by_index[0]]);
  for (std::size_t f : by_index) {
    const nlohmann::json d = common_part(docs[f]);
    if (d != first) {
      const nlohmann::json patch = nlohmann::json::diff(first, d);
      const std::string where = patch.empty() ? "?" : patch[0].value("path", std::string("?"));
      throw BadInput(names[f] + ": not a shard of the same run as " + names[by_index[0]] +
                     " (they differ at " + where + ")");
    }
  }

  nlohmann::json out = docs[by_index[0]];
  out.erase("shard");
  nlohmann::json& cps = out["checkpoints"];
  for (std::size_t c = 0; c < cps.size(); ++c) {
    nlohmann::json& layers = cps[c]["layers"];
    for (std::size_t l = 0; l < layers.size(); ++l) {
      nlohmann::json& L = layers[l];
      const bool has = L.contains("jacobian");
      for (std::size_t f : by_index)
        if (docs[f].at("checkpoints").at(c).at("layers").at(l).contains("jacobian") != has)
          throw BadInput(names[f] + ": layer " + L.value("index", nlohmann::json()).dump() +
                         (has ? " has no" : " has a") + " \"jacobian\" list, unlike " +
                         names[by_index[0]]);
      if (!has) continue;
      std::vector<nlohmann::json> entries;
      for (std::size_t f : by_index) {
        const nlohmann::json& Lf = docs[f].at("checkpoints").at(c).at("layers").at(l);
        for (const nlohmann::json& e : Lf.at("jacobian")) {
          if (!e.is_object() || !e.contains("head") || !e["head"].is_number_integer())
            throw BadInput(names[f] + ": a \"jacobian\" entry without an integer \"head\"");
          entries.push_back(e);
        }
      }
      std::stable_sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) {
        return a["head"].template get<std::int64_t>() < b["head"].template get<std::int64_t>();
      });
      for (std::size_t e = 1; e < entries.size(); ++e)
        if (entries[e]["head"] == entries[e - 1]["head"])
          throw BadInput("merge: head " + entries[e]["head"].dump() + " of layer " +
                         L.value("index", nlohmann::json()).dump() +
                         " is in two shards (shards of different runs?)");
      if (entries.empty()) {
        for (const char* k : kJacobianFields) L.erase(k);  // as the unsharded run writes it
      } else {
        L["jacobian"] = entries;
      }
    }
  }
  return out;
}

}  // namespace spectral_cond::engine
