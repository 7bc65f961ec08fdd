// spectral-cond merge: one `analyze` report from the JSON reports of its shards (merge.hpp).
//
//   spectral-cond analyze CKPT --jacobian --shard 0/2 --format json --out s0.json   (job 1)
//   spectral-cond analyze CKPT --jacobian --shard 1/2 --format json --out s1.json   (job 2)
//   spectral-cond merge s0.json s1.json [--out FILE] [--quiet]
//
// The result is the JSON report of the unsharded run (the "seconds" timings aside).
#include <spectral_cond/engine/analysis_format.hpp>
#include <spectral_cond/engine/inputs.hpp>
#include <spectral_cond/engine/merge.hpp>
#include "analysis_cli.hpp"
#include "commands.hpp"

#include <spectral_cond/io/atomic_file.hpp>
#include <spectral_cond/io/files.hpp>

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace spectral_cond::cli {

namespace {

/// Largest shard report read (a 100-layer model with 100 heads each writes about 100 MB).
constexpr std::int64_t kMaxReportBytes = std::int64_t{1} << 30;

std::string read_report(const std::string& path) {
  struct stat st {};
  const int fd = io::open_input(path, st);
  std::unique_ptr<int, void (*)(int*)> guard(new int(fd), [](int* p) {
    ::close(*p);
    delete p;
  });
  if (st.st_size > kMaxReportBytes)
    throw BadInput(path + ": " + std::to_string(st.st_size) +
                   " bytes is larger than any shard report (at most 1 GiB)");
  std::string text(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, &text[got], text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw BadInput(path + ": cannot read: " + std::strerror(errno));
    if (n == 0) throw BadInput(path + ": shorter than its size (changed while read?)");
    got += static_cast<std::size_t>(n);
  }
  return text;
}

}  // namespace

void register_merge(CLI::App& app) {
  struct Args {
    std::vector<std::string> shards;
    std::string out;
    bool quiet = false;
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "merge", "one analyze report from the JSON reports of its shards (analyze --shard I/N)");
  cmd->add_option("shard", a->shards, "the reports of analyze --shard I/N --format json, each once")
      ->required();
  cmd->add_option("--out", a->out, "write the report to FILE (atomically) instead of stdout");
  cmd->add_flag("--quiet", a->quiet, "no message on stderr");
  cmd->callback([a] {
    if (!a->out.empty()) io::check_output_target(a->out, a->shards);
    std::vector<nlohmann::json> docs;
    for (const std::string& p : a->shards) {
      try {
        docs.push_back(nlohmann::json::parse(read_report(p)));
      } catch (const nlohmann::json::exception& e) {  // malformed, or a number out of range
        throw BadInput(p + ": not JSON, or a number beyond double (" + std::string(e.what()) + ")");
      }
    }
    nlohmann::json merged;
    try {
      merged = merge_shards(docs, a->shards);
    } catch (const nlohmann::json::exception& e) {  // a field of an unexpected type
      throw BadInput("merge: a shard is not a report of analyze --format json (" +
                     std::string(e.what()) + ")");
    }
    const std::string text = json_text(merged);
    if (a->out.empty()) {
      std::cout << text << std::flush;
    } else {
      io::atomic_write_bytes(a->out, text.data(), text.size());
      if (!a->quiet) std::cerr << "spectral-cond: merged report written to " << a->out << '\n';
    }
    fail_if_declined(declined_kappa_j(merged));
  });
}

}  // namespace spectral_cond::cli
